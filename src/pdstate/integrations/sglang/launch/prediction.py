"""SGLang launch arguments -> the DSV4 state layout each server will build (``pdstate check --sglang``).

``predict(role, text, model_config=None)`` reads one server's launch, written as operators write
it::

    SGLANG_OPT_USE_ONLINE_COMPRESS=1 python -m sglang.launch_server --model-path ... --tp 8 ...

(leading ``VAR=value`` tokens are its environment; SGLang's entry point and a wrapper before it are
recognised, ``command.read_launch``), or ``@path`` (a launch script), or ``http://host:port`` (a running server's
``/get_server_info``, read-only; leading ``VAR=value`` tokens still give the environment, which a
server does not report). The arguments are parsed by the release's own parser (``argtable``), with
SGLang's ``--config`` YAML merged. It returns an ``SGLangSide``: what the release resolves those arguments
to for a ``DeepseekV4ForCausalLM`` — the values that shape the transferred state — plus notes
(flags SGLang overrides), what pdstate does not model (listed, never guessed) and what would stop
the server from starting. ``SGLangSide.pool_settings()`` turns it into pdstate's own pool model.

Facts of SGLang 0.5.19 and 0.5.23 used here (read from their source):
- DSV4 on CUDA runs with ``page_size`` 256 whatever ``--page-size`` says (NPU: 128);
- ``--kv-cache-dtype auto`` resolves to ``fp8_e4m3``; DSV4 accepts only ``fp8_e4m3`` and
  ``bfloat16``, and the paged pool stores fp8 only (bfloat16 is the NPU dtype);
- the DSV4 defaults run before the speculative ones, so ``--speculative-algorithm`` must be spelled
  ``EAGLE`` (``NEXTN`` fails its assert) with ``--speculative-eagle-topk 1`` and
  ``--speculative-num-steps N``; the draft tokens are then ``N + 1``; the draft is the model's
  1-layer NextN (SWA-only);
- the compressor rings are speculative whenever an algorithm is set (C4 16 vs 8, C128 256 vs 128);
- ``SGLANG_OPT_USE_ONLINE_COMPRESS`` (not on ROCm) makes the C128 state online (ring 1), refused
  with speculation unless ``SGLANG_EXPERIMENTAL_ONLINE_C128_MTP``; unified KV is ROCm with
  ``SGLANG_HACK_FLASHMLA_BACKEND=unified_kv_triton``; ``SGLANG_DSV4_COMPRESS_STATE_DTYPE`` is the
  state dtype (float32 by default);
- the layer layout and window come from the model's ``config.json`` (``compress_ratios``,
  ``num_hidden_layers``, ``sliding_window``), overridable by ``--json-model-override-args``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdstate.errors import ConfigError, SGLangArgsError  # noqa: F401  (SGLangArgsError: re-exported)
from pdstate.integrations.sglang.launch.command import (
    ARCH,
    FLASH,
    MODELLED,
    RULE_INPUTS,
    SPEC_DEFAULTS,
    Launch,
    _bool_env,
    _int,
    apply_model_config,
    env_kind,
    fetch_server_info,
    field_kind,
    merge_config,
    parse_argv,
    read_launch,
    read_model_config,
)

# The SGLang releases pdstate's pool model builds (``pdstate.pools.dsv4.UPSTREAM_RELEASES``; this
# module stays torch-free, a test keeps the two equal).
SUPPORTED_RELEASES = ("0.5.19", "0.5.23")


def default_release() -> tuple[str, str]:
    """``(release, why)``: the installed SGLang's when pdstate models it, else the newest."""
    from importlib import metadata

    try:
        installed = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        installed = None
    if installed in SUPPORTED_RELEASES:
        return installed, "the installed SGLang"
    return SUPPORTED_RELEASES[-1], "default: the newest release"


# --- the prediction -------------------------------------------------------------------------------


@dataclass
class SGLangSide:
    """What one SGLang server resolves to, in the terms that shape the transferred DSV4 state."""

    role: str  # "prefill" | "decode": the position it was given in
    origin: str  # "arguments", "@path", "http://..."
    model: str
    layout_source: str  # where the layer layout came from
    compress_ratios: list[int]
    num_hidden_layers: int
    sliding_window: int
    window_source: str
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    index_head_dim: int = 128
    page_size: int = 256
    kv_cache_dtype: str = "fp8_e4m3"
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    online_c128: bool = False
    online_c128_mtp: bool = False
    unified_kv: bool = False
    state_dtype: str = "float32"
    disaggregation_mode: str = "null"
    transfer_backend: str = "mooncake"
    tp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    pp_size: int = 1
    attn_tp_size: int = 1
    attn_cp_size: int = 1
    dcp_size: int = 1
    decode_radix_cache: bool = False
    env: dict[str, str] = field(default_factory=dict)
    release: str = "0.5.23"  # the SGLang release whose pools this side builds (pdstate's pool model follows it)
    release_source: str = "default: the newest release"
    given: dict[str, str] = field(default_factory=dict)  # ServerArgs field -> the flag as written
    notes: list[str] = field(default_factory=list)
    not_modelled: list[str] = field(default_factory=list)
    launch_errors: list[str] = field(default_factory=list)  # why SGLang would not start
    neutral: list[str] = field(default_factory=list)  # given settings that do not touch the layout
    unknown: list[str] = field(default_factory=list)  # what SGLang's own parser does not know

    @property
    def speculative(self) -> bool:
        return self.speculative_algorithm is not None

    @property
    def stage_ratios(self) -> list[int]:
        return list(self.compress_ratios[: self.num_hidden_layers])

    def spec_flags(self) -> str:
        """The speculative flags as DSV4 needs them written (empty when not speculative)."""
        if not self.speculative:
            return ""
        return (
            f"--speculative-algorithm {self.speculative_algorithm} --speculative-num-steps "
            f"{self.speculative_num_steps} --speculative-eagle-topk {self.speculative_eagle_topk} "
            f"--speculative-num-draft-tokens {self.speculative_num_draft_tokens}"
        )

    def describe(self) -> str:
        from pdstate.protocol.fixes import count_layers

        spec = (
            f"{self.speculative_algorithm} ({self.speculative_num_steps} steps, "
            f"{self.speculative_num_draft_tokens} draft tokens, 1-layer NextN draft)"
            if self.speculative
            else "not speculative"
        )
        parts = [
            f"{self.model} [{count_layers(self.stage_ratios)}; {self.layout_source}]",
            f"page {self.page_size}",
            f"kv {self.kv_cache_dtype}",
            f"window {self.sliding_window}",
            spec,
            "unified KV" if self.unified_kv else "paged",
        ]
        if self.online_c128:
            parts.append("online C128" + (" (MTP)" if self.online_c128_mtp else ""))
        if self.state_dtype != "float32":
            parts.append(f"state {self.state_dtype}")
        parts.append(f"tp {self.tp_size} dp {self.dp_size}" + (" dp-attention" if self.enable_dp_attention else ""))
        parts.append(f"SGLang {self.release} ({self.release_source})")
        return ", ".join(parts)

    def pool_settings(self):
        """pdstate's pool model for this side, with small capacities (the report's factors do
        not depend on pool sizes)."""
        from pdstate.pools.presets import PoolSettings

        kv = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "bfloat16": "bfloat16"}.get(
            self.kv_cache_dtype, self.kv_cache_dtype
        )
        return PoolSettings(
            compression_ratios=tuple(self.compress_ratios),
            layer_num=self.num_hidden_layers,
            full_tokens=4 * self.page_size,
            swa_tokens=2 * self.page_size,
            max_num_reqs=1,
            page_size=self.page_size,
            swa_page_size=self.page_size,
            sliding_window=self.sliding_window,
            kv_dtype=kv,
            state_dtype=self.state_dtype,
            qk_nope_head_dim=self.head_dim - self.qk_rope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            indexer_head_dim=self.index_head_dim,
            unified_kv=self.unified_kv,
            speculative_num_draft_tokens=self.speculative_num_draft_tokens if self.speculative else None,
            online_c128=self.online_c128,
            online_c128_mtp=self.online_c128_mtp,
            draft_enabled=self.speculative,
            draft_layers=1,
            upstream=self.release,
        )


def predict(
    role: str, text: str, model_config: str | None = None, timeout_s: float = 5.0, release: str | None = None
) -> SGLangSide:
    """One server's resolved DSV4 layout settings from its launch string (see the module doc).

    ``release`` is the SGLang release the server runs (``"0.5.19"`` / ``"0.5.23"``); a running
    server's ``/get_server_info`` says it itself (its ``version``), else the installed SGLang's, else
    the newest, is assumed."""
    rel, why = (release, "--sglang-version") if release is not None else default_release()
    launch = read_launch(text)
    ref = launch.launcher
    if not launch.argv and not launch.entry and re.match(r"^https?://\S+$", ref):
        info = fetch_server_info(ref, timeout_s)
        side = _from_server_info(role, ref, info, launch.env, model_config, rel, why, explicit=release is not None)
        return side
    origin = "arguments"
    if not launch.argv and not launch.entry and ref.startswith("@") and " " not in ref:
        path = Path(ref[1:])
        try:
            file_text = path.read_text()
        except OSError as exc:
            raise SGLangArgsError(f"{ref}: {exc.strerror or exc}") from None
        origin = ref
        inner = read_launch(file_text, base_dir=path.parent)
        inner.env = {**inner.env, **launch.env}
        launch = inner
    return predict_launch(role, origin, launch, model_config, rel, why)


def predict_launch(
    role: str, origin: str, launch: Launch, model_config: str | None, release: str, release_source: str
) -> SGLangSide:
    """One server from its ``Launch``, parsed by SGLang ``release``'s own parser (with its ``--config``)."""
    argv, config_file = merge_config(launch.argv, release, launch.base_dir)
    parsed = parse_argv(argv, release)
    kinds = {dest: field_kind(dest) for dest in parsed.given}
    values = {d: v for d, v in parsed.values.items() if kinds.get(d) == "modelled" or d in RULE_INPUTS}
    given = {d: t for d, t in parsed.given.items() if kinds[d] == "modelled"}
    side = _resolve(role, origin, values, given, launch.env, model_config, resolved=False, release=release)
    side.release, side.release_source = release, release_source
    side.not_modelled[:0] = [t for d, t in parsed.given.items() if kinds[d] == "not modelled"]
    side.neutral = [t for d, t in parsed.given.items() if kinds[d] == "neutral"]
    side.neutral += [f"{k}={v}" for k, v in launch.env.items() if env_kind(k) == "neutral"]
    side.unknown = parsed.unknown
    if parsed.error:
        side.launch_errors.insert(0, parsed.error)
    notes = list(launch.notes)
    if launch.launcher:
        notes.append(f"run by {launch.launcher} (its own flags are not SGLang's)")
    if config_file:
        notes.append(f"--config {config_file} read as SGLang merges it (the command line wins)")
    notes += parsed.deprecated
    side.notes[:0] = notes
    return side


def _from_server_info(
    role: str, origin: str, info: dict, env: dict, model_config: str | None, release: str, why: str, explicit: bool
) -> SGLangSide:
    values = {k: info[k] for k in MODELLED if k in info and info[k] is not None}
    given = {k: f"--{k.replace('_', '-')} {v}" for k, v in values.items()}
    version = str(info.get("version") or "")
    side = _resolve(role, origin, values, given, env, model_config, resolved=True, release=release)
    side.release, side.release_source = release, why
    if explicit:
        pass
    elif version in SUPPORTED_RELEASES:
        side.release, side.release_source = version, "the server's /get_server_info"
    elif version:
        side.notes.append(
            f"the server runs SGLang {version}, which pdstate does not model; predicted as {side.release}"
        )
    side.notes.append(
        "from a running server's /get_server_info: SGLang's resolved values; its environment is not "
        "reported (give VAR=value before the URL)"
    )
    return side


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


def _resolve(
    role: str,
    origin: str,
    values: dict[str, Any],
    given: dict[str, str],
    env: dict[str, str],
    model_config: str | None,
    *,
    resolved: bool,
    release: str = SUPPORTED_RELEASES[-1],
) -> SGLangSide:
    """Apply SGLang ``release``'s DSV4 resolution to the given values (``resolved``: they are already
    the server's resolved values, from ``/get_server_info``)."""
    f = _Findings()
    model_path = values.get("model_path")
    cfg, source = read_model_config(model_path, model_config)
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
    (attention TP = TP / attention DP / attention CP; 0.5.23 also takes ``--attn-dp-size``)."""
    tp = _int(values, "tp_size", 1) or 1
    dp = _int(values, "dp_size", 1) or 1
    dp_attention = values.get("enable_dp_attention") in (True, "true", "True")
    attn_dp = dp if dp_attention else 1
    if release != "0.5.19" and values.get("attn_dp_size") not in (None, 1):
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
    errors = []
    dp = _int(values, "dp_size", 1) or 1
    dp_attention = topo["attn_dp_size"] > 1 and (release != "0.5.19" or dp > 1)
    if dp_attention and values.get("enable_dp_lm_head") not in (True, "true", "True"):
        errors.append("ValueError: DSpark with dp attention requires --enable-dp-lm-head.")
    if release != "0.5.19":
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
    allowed = (None,) if release == "0.5.19" else (None, "DSPARK", "EAGLE", "EAGLE3")
    if algo not in allowed:
        errors.append(
            f"ValueError: {flag} is incompatible with speculative decoding (--speculative-algorithm {algo}; "
            f"SGLang {release}{' allows EAGLE and DSPARK from 0.5.23' if release == '0.5.19' else ''})"
        )
    return errors
