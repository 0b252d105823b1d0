"""SGLang's own DSV4 resolution, per release (its row's traits: ``releases``): the values it gives a server's
arguments and environment, the flags it overrides (notes), and the asserts and start-time rules
that stop it (``launch_errors``). ``resolve`` turns one server's values into an ``SGLangSide``; what
reads those values from a launch or a running server is ``prediction``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pdstate.errors import SGLangArgsError
from pdstate.integrations.sglang import releases
from pdstate.integrations.sglang.launch.coverage import env_kind
from pdstate.integrations.sglang.launch.model import ARCH, FLASH, apply_model_config, read_model_config
from pdstate.integrations.sglang.launch.side import SGLangSide
from pdstate.protocol.factors import launch_settings

SPEC_DEFAULTS = (3, 1, 4)  # SGLang's auto-chosen (steps, topk, draft tokens) for DeepSeek models


def _int(values: dict, fld: str, default: int | None) -> int | None:
    v = values.get(fld, default)
    if v is None or isinstance(v, int):
        return v
    try:
        return int(v)
    except (TypeError, ValueError):
        raise SGLangArgsError(f"--{fld.replace('_', '-')}: expected an integer, got {v!r}") from None


def _bool_env(env: dict[str, str], name: str) -> bool:
    v = env.get(name)
    if v is None:
        return False
    if v.lower() in ("true", "1", "yes", "y"):
        return True
    if v.lower() in ("false", "0", "no", "n"):
        return False
    raise SGLangArgsError(f'{name}={v}: "{v}" is not a valid boolean value (SGLang reads true/1/yes/y or false/0/no/n)')


@dataclass
class _Findings:
    notes: list[str] = field(default_factory=list)
    not_modelled: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # why SGLang would not start


def _resolve_env(env: dict[str, str], f: _Findings) -> dict[str, Any]:
    """Unified KV, online C128 and the state dtype from the environment variables."""
    unified = env.get("SGLANG_HACK_FLASHMLA_BACKEND") == "unified_kv_triton"
    if unified:
        f.notes.append("SGLANG_HACK_FLASHMLA_BACKEND=unified_kv_triton: unified KV (ROCm only; on CUDA it is ignored)")
    elif env.get("SGLANG_HACK_FLASHMLA_BACKEND", "tilelang") != "tilelang":
        f.not_modelled.append(f"SGLANG_HACK_FLASHMLA_BACKEND={env['SGLANG_HACK_FLASHMLA_BACKEND']}")
    online = _bool_env(env, "SGLANG_OPT_USE_ONLINE_COMPRESS")
    if online and unified:
        f.notes.append("SGLANG_OPT_USE_ONLINE_COMPRESS is ignored on ROCm (unified KV): offline C128 state")
        online = False
    state = env.get("SGLANG_DSV4_COMPRESS_STATE_DTYPE", "float32").strip().lower()
    state_dtype = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}.get(state)
    if state_dtype is None:
        f.errors.append(
            f"ValueError: Unsupported SGLANG_DSV4_COMPRESS_STATE_DTYPE={state!r}. "
            "Expected one of: float32, fp32, bfloat16, bf16."
        )
        state_dtype = "float32"
    for k in env:
        if env_kind(k) == "not modelled":
            f.not_modelled.append(f"{k}={env[k]}")
    return {
        "unified_kv": unified,
        "online_c128": online,
        "online_c128_mtp": _bool_env(env, "SGLANG_EXPERIMENTAL_ONLINE_C128_MTP"),
        "state_dtype": state_dtype,
    }


def _resolve_page_and_kv(
    values: dict, npu: bool, unified: bool, resolved: bool, f: _Findings, release: str
) -> dict[str, Any]:
    page = _int(values, "page_size", None)
    if resolved:
        page_size = page if page is not None else 256
    else:  # DSV4's override replaces whatever --page-size says
        page_size = 128 if npu else 256
        if page is not None and page != page_size:
            f.notes.append(
                f"--page-size {page} is overridden: SGLang {release} runs {ARCH} with page_size {page_size} "
                f"on {'NPU' if npu else 'CUDA'}"
            )
    kv = str(values.get("kv_cache_dtype", "auto"))
    kv = {"bf16": "bfloat16"}.get(kv, kv)
    if kv == "auto" and resolved:
        f.notes.append(
            f"the server reports kv_cache_dtype auto: SGLang runs {ARCH} with {'bfloat16' if npu else 'fp8_e4m3'}"
        )
    if kv == "auto" or (npu and not resolved):
        kv = "bfloat16" if npu else "fp8_e4m3"
    if not resolved:
        if kv not in ("fp8_e4m3", "bfloat16"):
            f.errors.append(f"AssertionError: {kv} is not supported for {ARCH} (--kv-cache-dtype fp8_e4m3 or auto)")
    if kv == "bfloat16" and not unified and not npu:
        f.errors.append(
            "--kv-cache-dtype bfloat16: the paged DSV4 KV pool stores fp8 only (SGLang asserts a uint8 store); "
            "bfloat16 is the NPU dtype"
        )
    return {"page_size": page_size, "kv_cache_dtype": kv}


def _resolve_speculative(values: dict, env_kw: dict, kv: str, resolved: bool, f: _Findings) -> dict[str, Any]:
    """Algorithm, steps, topk and draft tokens as SGLang resolves them for DSV4 (EAGLE, topk 1,
    draft tokens = steps + 1), with the asserts that stop it on the way."""
    algo = values.get("speculative_algorithm")
    if algo is None:
        return {}
    algo = str(algo)
    steps = _int(values, "speculative_num_steps", None)
    topk = _int(values, "speculative_eagle_topk", None)
    draft_tokens = _int(values, "speculative_num_draft_tokens", None)
    if algo.upper() == "DSPARK":
        f.not_modelled.append("--speculative-algorithm DSPARK (the DSpark draft's state)")
    elif not resolved:
        if algo != "EAGLE":
            f.errors.append(
                f"AssertionError: Only EAGLE and DSPARK speculative algorithms are supported for {ARCH} "
                f"(--speculative-algorithm {algo}: SGLang checks this before it resolves aliases; write EAGLE)"
            )
        if topk != 1:
            f.errors.append(
                f"AssertionError: Only EAGLE speculative algorithm with topk == 1 is supported for {ARCH} "
                f"(--speculative-eagle-topk {topk}: write --speculative-eagle-topk 1)"
            )
        if steps is None:
            if topk is not None or draft_tokens is not None:
                f.errors.append(
                    "AssertionError in SGLang's speculative defaults: with --speculative-eagle-topk or "
                    "--speculative-num-draft-tokens given, --speculative-num-steps is required"
                )
            steps = SPEC_DEFAULTS[0]
        if draft_tokens is not None and draft_tokens != steps + 1:
            f.notes.append(
                f"--speculative-num-draft-tokens {draft_tokens} is adjusted to {steps + 1} "
                "(speculative_num_steps + 1 with topk 1)"
            )
        topk, draft_tokens = 1, steps + 1
        if values.get("speculative_draft_model_path"):
            f.notes.append(
                "--speculative-draft-model-path: DeepSeek MTP does not need it (SGLang warns); the draft is the NextN layer"
            )
    if env_kw["online_c128"] and not env_kw["online_c128_mtp"]:
        f.errors.append(
            "AssertionError: online c128 does not support MTP (SGLANG_OPT_USE_ONLINE_COMPRESS with speculative "
            "decoding needs SGLANG_EXPERIMENTAL_ONLINE_C128_MTP=1)"
        )
        env_kw["online_c128_mtp"] = True  # predict the layout it would have with the option
    dkv = values.get("speculative_draft_kv_cache_dtype")
    if dkv not in (None, "auto", "fp8_e4m3", kv):
        f.not_modelled.append(f"--speculative-draft-kv-cache-dtype {dkv}")
    return {
        "speculative_algorithm": "EAGLE" if algo.upper() in ("EAGLE", "NEXTN") else algo,
        "speculative_num_steps": steps if steps is not None else SPEC_DEFAULTS[0],
        "speculative_eagle_topk": topk if topk is not None else SPEC_DEFAULTS[1],
        "speculative_num_draft_tokens": draft_tokens if draft_tokens is not None else SPEC_DEFAULTS[2],
    }


def resolve(
    role: str,
    origin: str,
    values: dict[str, Any],
    given: dict[str, str],
    env: dict[str, str],
    model_config: str | None,
    *,
    resolved: bool,
    release: str,
    model_names: tuple[str, ...] = (),
) -> SGLangSide:
    """Apply SGLang ``release``'s DSV4 resolution to the given values (``resolved``: they are already
    the server's resolved values, from ``/get_server_info``; ``model_names``: other names of the
    model, such as a recipe's model alias, read after ``--model-path`` and ``--served-model-name``)."""
    f = _Findings()
    model_path = values.get("model_path")
    served = values.get("served_model_name")
    cfg, source = read_model_config(model_path, model_config, (*([served] if served else []), *model_names))
    overrides: Any = {}
    raw = values.get("json_model_override_args")
    if raw not in (None, "", "{}"):
        try:
            overrides = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError as exc:
            f.errors.append(f"json.JSONDecodeError in --json-model-override-args: {exc}")
        if not isinstance(overrides, dict):
            f.errors.append("--json-model-override-args is not a JSON object")
            overrides = {}
    kw: dict[str, Any] = {}
    extra = apply_model_config(kw, cfg, source, overrides, "--json-model-override-args")
    f.not_modelled += [f"--json-model-override-args {k}" for k in extra]

    device = values.get("device") or "cuda"
    if device != "cuda":
        f.not_modelled.append(
            "--device npu (DSV4 on NPU builds DSV4NPUTokenToKVPool)"
            if device == "npu"
            else f"--device {device} (pdstate models DSV4 on CUDA)"
        )
    env_kw = _resolve_env(env, f)
    kw.update(_resolve_page_and_kv(values, device == "npu", env_kw["unified_kv"], resolved, f, release))
    kw.update(_resolve_speculative(values, env_kw, kw["kv_cache_dtype"], resolved, f))
    kw.update(env_kw)
    if values.get("attention_backend") not in (None, "dsv4", "compressed") and not resolved:
        f.notes.append(f"--attention-backend {values['attention_backend']} is overridden: {ARCH} runs the dsv4 backend")
    for fld, why in (
        ("enable_hisparse", "HiSparse swaps the C4 pool"),
        ("enable_deepseek_v4_fp4_indexer", "fp4 indexer rows of 68 B/token"),
        ("enable_prefill_cp", "prefill context parallelism"),
    ):
        if values.get(fld) in (True, "true", "True"):
            f.not_modelled.append(f"--{fld.replace('_', '-')} ({why})")
    backend = str(values.get("disaggregation_transfer_backend", "mooncake"))
    topo = _topology(values, release)
    if topo["pp_size"] > 1 and backend != "pdstate":
        f.not_modelled.append(f"--pp-size {topo['pp_size']} (pdstate compares one whole-model stage)")
    if (topo["attn_cp_size"] > 1 or topo["dcp_size"] > 1) and backend != "pdstate":
        f.not_modelled.append(
            f"context parallelism (attn_cp_size {topo['attn_cp_size']}, dcp_size {topo['dcp_size']}): "
            "pdstate compares one rank's state"
        )
    mode = str(values.get("disaggregation_mode", "null"))
    radix = values.get("disaggregation_decode_enable_radix_cache") in (True, "true", "True")
    algo = kw.get("speculative_algorithm")
    if mode == "decode" and radix and not resolved:
        f.errors += _decode_radix_errors(values, algo, backend, release)
    policy = str(values.get("disaggregation_decode_allocation_policy") or "early")
    if policy == "prefill_complete" and not resolved:
        f.errors += _prefill_complete_errors(values, topo, mode, backend, env, f)
    if algo is not None and algo.upper() == "DSPARK" and not resolved:
        f.errors += _dspark_errors(values, topo, mode, release)
    return SGLangSide(
        role=role,
        origin=origin,
        model=str(model_path or FLASH),
        disaggregation_mode=mode,
        transfer_backend=backend,
        tp_size=_int(values, "tp_size", 1) or 1,
        dp_size=_int(values, "dp_size", 1) or 1,
        enable_dp_attention=topo.pop("attn_dp_size") > 1,
        decode_radix_cache=mode == "decode" and radix,
        tokenizer_worker_num=_int(values, "tokenizer_worker_num", 1) or 1,
        settings=launch_settings(values),
        env=dict(env),
        given=given,
        notes=f.notes,
        not_modelled=f.not_modelled,
        launch_errors=f.errors,
        release=release,
        **topo,
        **kw,
    )


def _topology(values: dict, release: str) -> dict[str, int]:
    """Pipeline, attention-DP/TP and context-parallel widths as SGLang ``release`` derives them
    (attention TP = TP / attention DP / attention CP; ``attn_dp_size_flag``: ``--attn-dp-size`` too)."""
    tp = _int(values, "tp_size", 1) or 1
    dp = _int(values, "dp_size", 1) or 1
    dp_attention = values.get("enable_dp_attention") in (True, "true", "True")
    attn_dp = dp if dp_attention else 1
    if releases.row(release).attn_dp_size_flag and values.get("attn_dp_size") not in (None, 1):
        attn_dp = _int(values, "attn_dp_size", 1) or 1
    cp = _int(values, "attn_cp_size", 1) or 1
    return {
        "pp_size": _int(values, "pp_size", 1) or 1,
        "attn_dp_size": attn_dp,
        "attn_tp_size": max(tp // attn_dp // cp, 1),
        "attn_cp_size": cp,
        "dcp_size": _int(values, "dcp_size", 1) or 1,
    }


def _dspark_errors(values: dict, topo: dict, mode: str, release: str) -> list[str]:
    """SGLang ``release``'s start-time refusals of a DSpark speculative server (its PD rules)."""
    row = releases.row(release)
    errors = []
    dp = _int(values, "dp_size", 1) or 1
    dp_attention = topo["attn_dp_size"] > 1 and (row.attn_dp_size_flag or dp > 1)
    if dp_attention and values.get("enable_dp_lm_head") not in (True, "true", "True"):
        errors.append("ValueError: DSpark with dp attention requires --enable-dp-lm-head.")
    if row.dspark_pd_rules:
        if dp_attention and topo["attn_cp_size"] > 1:
            errors.append(
                "ValueError: DSpark with dp attention does not support context parallel "
                f"(attn_cp_size={topo['attn_cp_size']})."
            )
        if topo["pp_size"] != 1 and mode != "prefill":
            errors.append(
                "ValueError: DSpark pipeline parallelism requires PD prefill; decode and non-disaggregated "
                "serving require pp_size == 1."
            )
    return errors


def _decode_radix_errors(values: dict, algo: str | None, backend: str, release: str) -> list[str]:
    """SGLang ``release``'s refusals of ``--disaggregation-decode-enable-radix-cache`` on a decode."""
    flag = "--disaggregation-decode-enable-radix-cache"
    errors = []
    if values.get("enable_hisparse") in (True, "true", "True"):
        errors.append(f"ValueError: {flag} is incompatible with --enable-hisparse")
    if backend == "fake":
        errors.append(f"ValueError: {flag} is incompatible with --disaggregation-transfer-backend fake")
    allowed = releases.row(release).decode_radix_spec
    if algo not in allowed:
        # a release that allows no algorithm names the first that allows EAGLE
        later = [r.version for r in releases.RELEASES if "EAGLE" in r.decode_radix_spec] if allowed == (None,) else []
        since = f" allows EAGLE and DSPARK from {later[0]}" if later else ""
        errors.append(
            f"ValueError: {flag} is incompatible with speculative decoding (--speculative-algorithm {algo}; "
            f"SGLang {release}{since})"
        )
    return errors


def _on(values: dict, fld: str) -> bool:
    return values.get(fld) in (True, "true", "True")


def _prefill_complete_errors(values: dict, topo: dict, mode: str, backend: str, env: dict, f: _Findings) -> list[str]:
    """SGLang 0.5.23's start-time refusal of ``--disaggregation-decode-allocation-policy
    prefill_complete`` (its PD hook lists what that policy does not support yet)."""
    tp = _int(values, "tp_size", 1) or 1
    unsupported = [
        what
        for what, yes in (
            ("aggregated serving", mode not in ("prefill", "decode")),
            ("transfer backends other than Mooncake", backend != "mooncake"),
            (
                "pipeline or attention context parallelism",
                topo["pp_size"] != 1 or topo["attn_cp_size"] != 1 or topo["dcp_size"] != 1,
            ),
            ("attention tensor parallelism greater than one", tp != topo["attn_dp_size"]),
            (
                "PD multiplexing or decoupled speculation",
                _on(values, "enable_pdmux") or str(values.get("decoupled_spec_role") or "null") != "null",
            ),
            ("runtime PD role switching", _on(values, "enable_pd_role_switch")),
            ("encoder disaggregation", _on(values, "encoder_only") or _on(values, "language_only")),
            ("HiSparse", _on(values, "enable_hisparse")),
            ("decode host KV buffering", float(values.get("disaggregation_decode_host_receive_threshold", 1)) < 1),
            (
                "decode radix cache or decode HiCache",
                mode == "decode"
                and (
                    _on(values, "disaggregation_decode_enable_radix_cache") or _on(values, "enable_hierarchical_cache")
                ),
            ),
            ("staging buffers", _bool_env(env, "SGLANG_DISAGG_STAGING_BUFFER")),
            ("the Rust bootstrap registry", _bool_env(env, "SGLANG_RUST_SERVER")),
        )
        if yes
    ]
    if mode == "prefill" and _on(values, "enable_hierarchical_cache"):
        f.not_modelled.append(
            "--enable-hierarchical-cache on a prefill_complete prefill (SGLang checks its write policy)"
        )
    if not unsupported:
        return []
    return [
        "ValueError: --disaggregation-decode-allocation-policy prefill_complete does not yet support "
        + ", ".join(unsupported)
    ]
