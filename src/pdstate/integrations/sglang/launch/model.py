"""The model a launch serves: DeepSeek-V4 by name (Flash built in, Pro by its config), and its
``config.json`` (``read_model_config``) turned into the layout fields (``apply_model_config``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pdstate.errors import SGLangArgsError
from pdstate.integrations.sglang.launch.coverage import CONFIG_KEYS

ARCH = "DeepseekV4ForCausalLM"
FLASH = "DeepSeek-V4-Flash"
PRO = "DeepSeek-V4-Pro"


def builtin_flash_config() -> dict:
    """DeepSeek-V4-Flash's ``config.json`` fields that shape the state (pdstate's ``dsv4-flash``)."""
    from pdstate.pools.presets import DSV4_FLASH_RATIOS

    return {
        "architectures": [ARCH],
        "num_hidden_layers": 43,
        "num_nextn_predict_layers": 1,
        "compress_ratios": list(DSV4_FLASH_RATIOS),
        "sliding_window": 128,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "index_head_dim": 128,
    }


_FLASH_NAME = re.compile(r"(deepseek[-_ ]?v4|dsv4)[-_. ]?flash", re.I)
_PRO_NAME = re.compile(r"(deepseek[-_ ]?v4|dsv4)[-_. ]?pro", re.I)
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
    """``"flash"``, ``"pro"`` or ``"other"`` from a model path or served name, ``None`` when unknown."""
    if not name:
        return None
    if _FLASH_NAME.search(name):
        return "flash"
    if _PRO_NAME.search(name):
        return "pro"
    if _OTHER_NAME.search(name):
        return "other"
    return None


def read_model_config(model_path: str | None, model_config: str | None) -> tuple[dict, str]:
    """The model's ``config.json`` fields and where they came from: ``--model-config``, the
    checkpoint directory's ``config.json``, else DeepSeek-V4-Flash's built-in layout when the name
    says Flash (the FP8, NVFP4 and dated checkpoints too)."""
    if model_config:
        path = Path(model_config)
        try:
            cfg = json.loads(path.read_text())
        except OSError as exc:
            raise SGLangArgsError(f"--model-config {model_config}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise SGLangArgsError(f"--model-config {model_config}: not JSON: {exc}") from None
        return cfg, f"config {model_config}"
    if model_path and (Path(model_path) / "config.json").is_file():
        path = Path(model_path) / "config.json"
        try:
            return json.loads(path.read_text()), f"config {path}"
        except ValueError as exc:
            raise SGLangArgsError(f"{path}: not JSON: {exc}") from None
    family = model_family(model_path)
    if model_path is None:
        return builtin_flash_config(), f"built-in {FLASH} layout"
    if family == "flash":
        named = "" if Path(model_path).name == FLASH else f", recognised from {Path(model_path).name!r}"
        return builtin_flash_config(), f"built-in {FLASH} layout{named}"
    if family == "pro":
        raise SGLangArgsError(
            f"model {model_path!r} is {PRO}: its published config.json is not built into pdstate; give it with "
            "--model-config PATH (or --model-path to the checkpoint directory)"
        )
    if family == "other":
        raise SGLangArgsError(not_dsv4(f"model {model_path!r}"))
    raise SGLangArgsError(
        f"cannot tell the layer layout of model {model_path!r}: give its config.json with --model-config PATH "
        f"(built in: {FLASH} and its FP8/NVFP4 checkpoints)"
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
