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

import re
from pathlib import Path

from pdstate.integrations.sglang import releases
from pdstate.integrations.sglang.launch.command import (
    Launch,
    fetch_server_info,
    merge_config,
    parse_argv,
    read_launch,
    read_text,
)
from pdstate.integrations.sglang.launch.coverage import MODELLED, RULE_INPUTS, env_kind, field_kind
from pdstate.integrations.sglang.launch.rules import resolve
from pdstate.integrations.sglang.launch.side import SGLangSide


def default_release() -> tuple[str, str]:
    """``(release, why)``: the installed SGLang's when pdstate models it, else the newest."""
    from importlib import metadata

    try:
        installed = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        installed = None
    if installed is not None and releases.find(installed) is not None:
        return installed, "the installed SGLang"
    return releases.newest().version, "default: the newest release"


# --- the prediction -------------------------------------------------------------------------------


def predict(
    role: str, text: str, model_config: str | None = None, timeout_s: float = 5.0, release: str | None = None
) -> SGLangSide:
    """One server's resolved DSV4 layout settings from its launch string (see the module doc).

    ``release`` is the SGLang release the server runs (a version of ``releases.RELEASES``); a running
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
        file_text = read_text(path, ref)
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
    side = resolve(
        role,
        origin,
        values,
        given,
        launch.env,
        model_config,
        resolved=False,
        release=release,
        model_names=tuple(launch.model_names),
    )
    side.release, side.release_source = release, release_source
    side.not_modelled[:0] = [t for d, t in parsed.given.items() if kinds[d] == "not modelled"]
    side.neutral = [t for d, t in parsed.given.items() if kinds[d] == "neutral"]
    side.neutral += [f"{k}={v}" for k, v in launch.env.items() if env_kind(k) == "neutral"]
    side.unknown = parsed.unknown
    if parsed.error:
        side.launch_errors.insert(0, parsed.error)
    notes = list(launch.notes)
    if launch.launcher:
        env = f"; the environment it sets is read: {', '.join(launch.wrapper_env)}" if launch.wrapper_env else ""
        notes.append(f"run by {launch.launcher} (its own flags are not SGLang's{env})")
    if launch.entry_flags:
        notes.append(f"{launch.entry}'s own flags, not SGLang's: {' '.join(launch.entry_flags)}")
    if config_file:
        notes.append(f"--config {config_file} read as SGLang merges it (the command line wins)")
    notes += parsed.deprecated
    side.notes[:0] = notes
    return side


def _from_server_info(
    role: str, origin: str, info: dict, env: dict, model_config: str | None, release: str, why: str, explicit: bool
) -> SGLangSide:
    values = {k: info[k] for k in MODELLED | RULE_INPUTS if k in info and info[k] is not None}
    given = {k: f"--{k.replace('_', '-')} {v}" for k, v in values.items()}
    version = str(info.get("version") or "")
    side = resolve(role, origin, values, given, env, model_config, resolved=True, release=release)
    side.release, side.release_source = release, why
    if explicit:
        pass
    elif releases.find(version) is not None:
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
