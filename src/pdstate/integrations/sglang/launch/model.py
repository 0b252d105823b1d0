"""The model a launch serves: DeepSeek-V4 by name (Flash and Pro built in, from their published
``config.json``), or its ``config.json`` (``read_model_config``), turned into the layout fields
(``apply_model_config``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pdstate.errors import SGLangArgsError
from pdstate.integrations.sglang.launch.coverage import CONFIG_KEYS

ARCH = "DeepseekV4ForCausalLM"
FLASH = "DeepSeek-V4-Flash"
PRO = "DeepSeek-V4-Pro"


def _dsv4_config(layers: int, ratios: list[int]) -> dict:
    """A DeepSeek-V4 ``config.json``'s fields that shape the state; Flash and Pro share all but the
    layer count and ``compress_ratios`` (window 128, head 512 with rope 64, indexer head 128, one
    NextN layer)."""
    return {
        "architectures": [ARCH],
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": 1,
        "compress_ratios": list(ratios),
        "sliding_window": 128,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "index_head_dim": 128,
    }


def builtin_flash_config() -> dict:
    """DeepSeek-V4-Flash's ``config.json`` fields that shape the state (pdstate's ``dsv4-flash``)."""
    from pdstate.pools.presets import DSV4_FLASH_RATIOS

    return _dsv4_config(43, DSV4_FLASH_RATIOS)


# DeepSeek-V4-Pro's published config.json (huggingface.co/deepseek-ai/DeepSeek-V4-Pro, config.json),
# the fields that shape the state: 61 layers, layers 0 and 1 C128, then C4 and C128 alternating
# from layer 2 (30 C4, 31 C128), and the NextN layer's placeholder 0 at the end (62 entries);
# sliding_window 128, head_dim 512, qk_rope_head_dim 64, index_head_dim 128, as Flash's.
PRO_RATIOS = [128, 128] + [4, 128] * 29 + [4, 0]


def builtin_pro_config() -> dict:
    """DeepSeek-V4-Pro's ``config.json`` fields that shape the state."""
    return _dsv4_config(61, PRO_RATIOS)


_FLASH_NAME = re.compile(r"(deepseek[-_ ]?v4|dsv4)[-_. ]?flash", re.I)
_PRO_NAME = re.compile(r"(deepseek[-_ ]?v4|dsv4)[-_. ]?pro", re.I)
# A Pro checkpoint with a date or release tag after its name (``-0813``, ``-ga-260813``) may have
# another layer layout than the published Pro's: only the quantised re-releases are taken as Pro.
_PRO_EXACT = re.compile(
    r"(deepseek[-_ ]?v4|dsv4)[-_. ]?pro([-_.](fp8|fp4|nvfp4|mxfp4|w4a8|w4afp8|int4|bf16))?/?$", re.I
)
_OTHER_NAME = re.compile(
    r"deepseek[-_ ]?(v2|v3|r1|coder|vl|math|moe|llm|prover|ocr)|qwen|llama|mistral|mixtral|glm|kimi|gemma|gpt|"
    r"phi-?\d|minimax|nemotron|mimo|granite|olmo",
    re.I,
)


def not_dsv4(what: str) -> str:
    """The one line for a model that is not DeepSeek-V4."""
    return (
        f"{what} is not a DeepSeek-V4 model: pdstate models DeepSeek-V4 state ({ARCH}); it does not check "
        "other architectures' KV layouts (SGLang's own bootstrap still compares page size and KV dtype)"
    )


def model_family(name: str | None) -> str | None:
    """``"flash"``, ``"pro"``, ``"pro-other"`` (a dated Pro checkpoint) or ``"other"`` from a model
    path or served name, ``None`` when unknown."""
    if not name:
        return None
    if _FLASH_NAME.search(name):
        return "flash"
    if _PRO_NAME.search(name):
        return "pro" if _PRO_EXACT.search(name.rstrip("/").split("/")[-1]) else "pro-other"
    if _OTHER_NAME.search(name):
        return "other"
    return None


def _read_json(path: Path, what: str) -> dict:
    from pdstate.integrations.sglang.launch.command import read_text

    text = read_text(path, what)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise SGLangArgsError(f"{what}: not JSON: {exc}") from None


_BUILTIN = {"flash": (FLASH, builtin_flash_config), "pro": (PRO, builtin_pro_config)}


def read_model_config(model_path: str | None, model_config: str | None, names: tuple = ()) -> tuple[dict, str]:
    """The model's ``config.json`` fields and where they came from: ``--model-config``, the
    checkpoint directory's ``config.json``, else DeepSeek-V4-Flash's or -Pro's built-in layout when
    the name says which (the model path first, then ``names``: the served model name, a recipe's
    model alias). No model path at all is DeepSeek-V4-Flash."""
    if model_config:
        return _read_json(Path(model_config), f"--model-config {model_config}"), f"config {model_config}"
    if model_path and (Path(model_path) / "config.json").is_file():
        path = Path(model_path) / "config.json"
        return _read_json(path, str(path)), f"config {path}"
    candidates = [n for n in (model_path, *names) if n]
    name, family = next(((n, model_family(n)) for n in candidates if model_family(n) is not None), (None, None))
    if family is None and model_path is None:
        return builtin_flash_config(), f"built-in {FLASH} layout"
    if family in _BUILTIN:
        label, config = _BUILTIN[family]
        seen = Path(str(name).rstrip("/")).name
        how = "" if name == model_path and seen == label else f", recognised from {seen!r}"
        return config(), f"built-in {label} layout{how}"
    if family == "pro-other":
        raise SGLangArgsError(
            f"model {name!r} is a DeepSeek-V4-Pro checkpoint other than the published {PRO}: its layer layout "
            "may differ; give its config.json with --model-config PATH (or --model-path to the checkpoint directory)"
        )
    if family == "other":
        raise SGLangArgsError(not_dsv4(f"model {name!r}"))
    raise SGLangArgsError(
        f"cannot tell the layer layout of model {model_path!r}: give its config.json with --model-config PATH "
        f"(built in: {FLASH}, {PRO} and their FP8/NVFP4 checkpoints)"
    )


def apply_model_config(side_kw: dict, cfg: dict, source: str, overrides: dict, override_flag: str) -> list[str]:
    """Fill the layout fields from ``cfg`` then ``overrides``; returns the override keys not modelled."""
    archs = cfg.get("architectures") or []
    if archs and archs[0] != ARCH:
        raise SGLangArgsError(not_dsv4(f"{source}: architecture {archs[0]}"))
    merged = {**cfg, **overrides}
    missing = [k for k in ("compress_ratios", "num_hidden_layers", "sliding_window") if k not in merged]
    if missing:
        raise SGLangArgsError(f"{source}: missing {', '.join(missing)}")
    ratios = merged["compress_ratios"]
    if not isinstance(ratios, list) or not all(isinstance(r, int) for r in ratios):
        raise SGLangArgsError(f"{source}: compress_ratios must be a list of integers")
    side_kw.update(
        compress_ratios=list(ratios),
        num_hidden_layers=int(merged["num_hidden_layers"]),
        sliding_window=int(merged["sliding_window"]),
        head_dim=int(merged.get("head_dim", 512)),
        qk_rope_head_dim=int(merged.get("qk_rope_head_dim", 64)),
        index_head_dim=int(merged.get("index_head_dim", 128)),
        window_source=f"{override_flag} sliding_window" if "sliding_window" in overrides else source,
        layout_source=source
        + ("" if not ({"compress_ratios", "num_hidden_layers"} & set(overrides)) else f" + {override_flag}"),
    )
    return [k for k in overrides if k not in CONFIG_KEYS]
