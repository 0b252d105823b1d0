"""Reading one SGLang launch: the arguments as operators write them (``VAR=value`` tokens, a
launcher, ``--flags``), ``@path`` files, a running server's ``/get_server_info``; and the tables of
what ``pdstate check --sglang`` models, ignores as layout-neutral, or lists as not modelled.
The model's ``config.json`` (``read_model_config``, ``apply_model_config``) is read here too. The
prediction over what is read is ``prediction``."""

from __future__ import annotations

import json
import re
import shlex
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pdstate.errors import SGLangArgsError

ARCH = "DeepseekV4ForCausalLM"
FLASH = "DeepSeek-V4-Flash"
SPEC_DEFAULTS = (3, 1, 4)  # SGLang's auto-chosen (steps, topk, draft tokens) for DeepSeek models

# ServerArgs field -> (its flags, whether it takes a value; False: a store_true switch).
MODELLED: dict[str, tuple[tuple[str, ...], bool]] = {
    "model_path": (("--model-path", "--model"), True),
    "page_size": (("--page-size",), True),
    "kv_cache_dtype": (("--kv-cache-dtype",), True),
    "speculative_algorithm": (("--speculative-algorithm",), True),
    "speculative_num_steps": (("--speculative-num-steps",), True),
    "speculative_eagle_topk": (("--speculative-eagle-topk",), True),
    "speculative_num_draft_tokens": (("--speculative-num-draft-tokens",), True),
    "speculative_draft_model_path": (("--speculative-draft-model-path", "--speculative-draft-model"), True),
    "speculative_draft_kv_cache_dtype": (("--speculative-draft-kv-cache-dtype",), True),
    "disaggregation_mode": (("--disaggregation-mode",), True),
    "disaggregation_transfer_backend": (("--disaggregation-transfer-backend",), True),
    "tp_size": (("--tp-size", "--tp", "--tensor-parallel-size"), True),
    "dp_size": (("--dp-size", "--dp", "--data-parallel-size"), True),
    "enable_dp_attention": (("--enable-dp-attention",), False),
    "pp_size": (("--pp-size", "--pipeline-parallel-size"), True),
    "json_model_override_args": (("--json-model-override-args",), True),
    "device": (("--device",), True),
    "attention_backend": (("--attention-backend",), True),
    # known to change the DSV4 state layout in ways pdstate's pool model does not build
    "enable_hisparse": (("--enable-hisparse",), False),
    "enable_deepseek_v4_fp4_indexer": (("--enable-deepseek-v4-fp4-indexer",), False),
    "enable_prefill_cp": (("--enable-prefill-cp",), False),
}

# Flags that size pools, pick kernels or serve HTTP: the transferred layout does not depend on them.
NEUTRAL_VALUE_FLAGS = frozenset(
    "--host --port --mem-fraction-static --max-running-requests --max-total-tokens --context-length "
    "--chunked-prefill-size --max-prefill-tokens --swa-full-tokens-ratio --served-model-name "
    "--tokenizer-path --log-level --dist-init-addr --nnodes --node-rank --disaggregation-bootstrap-port "
    "--disaggregation-ib-device --disaggregation-decode-extra-slots --ep-size --ep --expert-parallel-size "
    "--moe-a2a-backend --moe-runner-backend --deepep-mode --quantization --dtype --watchdog-timeout "
    "--load-format --revision --random-seed --api-key --base-gpu-id --schedule-policy --stream-interval "
    "--reasoning-parser --tool-call-parser --chat-template --cuda-graph-max-bs --decode-log-interval".split()
)
NEUTRAL_SWITCHES = frozenset(
    "--trust-remote-code --disable-cuda-graph --enable-metrics --disable-radix-cache --skip-server-warmup "
    "--enable-cache-report --enable-mixed-chunk".split()
)
# Environment variables that do not touch the layout (device selection, transport, Python).
NEUTRAL_ENV_PREFIXES = ("CUDA_", "NCCL_", "MC_", "MOONCAKE_", "UCX_", "NVSHMEM_", "PYTHON", "HF_", "TORCH", "OMP_")
NEUTRAL_ENV = frozenset({"SGLANG_HOST_IP", "TRANSFORMERS_OFFLINE"})
MODELLED_ENV = (
    "SGLANG_OPT_USE_ONLINE_COMPRESS",
    "SGLANG_EXPERIMENTAL_ONLINE_C128_MTP",
    "SGLANG_DSV4_COMPRESS_STATE_DTYPE",
    "SGLANG_HACK_FLASHMLA_BACKEND",
)
# Keys of --json-model-override-args / config.json the prediction reads.
CONFIG_KEYS = (
    "compress_ratios",
    "num_hidden_layers",
    "sliding_window",
    "head_dim",
    "qk_rope_head_dim",
    "index_head_dim",
)

_FLAG_OF = {name: fld for fld, (names, _) in MODELLED.items() for name in names}
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


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


# --- reading the source ---------------------------------------------------------------------------


def split_launch(text: str) -> tuple[dict[str, str], list[str], str]:
    """``(environment, argv, launcher)`` of a shell-style launch line (``\\``-newlines and ``#``
    comments allowed): leading ``VAR=value`` tokens, then any launcher words before the first
    ``--`` flag (``python -m sglang.launch_server``), then the arguments."""
    try:
        tokens = shlex.split(text.replace("\\\r\n", " ").replace("\\\n", " "), comments=True)
    except ValueError as exc:
        raise SGLangArgsError(f"cannot split the launch arguments: {exc}") from None
    env: dict[str, str] = {}
    i = 1 if tokens[:1] == ["env"] else 0
    while i < len(tokens) and _ENV_RE.match(tokens[i]):
        k, v = tokens[i].split("=", 1)
        env[k] = v
        i += 1
    j = i
    while j < len(tokens) and not tokens[j].startswith("--"):
        j += 1
    return env, tokens[j:], " ".join(tokens[i:j])


def fetch_server_info(url: str, timeout_s: float = 5.0) -> dict:
    """A running server's ``/get_server_info`` (``/server_info`` where the old path is gone)."""
    base = url.rstrip("/")
    for path in ("/get_server_info", "/server_info"):
        try:
            with urllib.request.urlopen(base + path, timeout=timeout_s) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and path == "/get_server_info":
                continue
            raise SGLangArgsError(f"GET {base}{path} answered {exc.code}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise SGLangArgsError(f"GET {base}{path}: {getattr(exc, 'reason', exc)}") from None
        try:
            info = json.loads(body)
        except ValueError:
            raise SGLangArgsError(f"GET {base}{path}: the answer is not JSON") from None
        if not isinstance(info, dict):
            raise SGLangArgsError(f"GET {base}{path}: expected a JSON object")
        return info
    raise SGLangArgsError(f"{base}: neither /get_server_info nor /server_info answered")  # pragma: no cover


def parse_argv(argv: list[str]) -> tuple[dict[str, Any], dict[str, str], list[str], list[str]]:
    """``(values by ServerArgs field, flag text by field, unknown flags, layout-neutral flags)``."""
    values: dict[str, Any] = {}
    given: dict[str, str] = {}
    unknown: list[str] = []
    neutral: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        if not tok.startswith("--"):
            unknown.append(tok)
            continue
        name, eq, inline = tok.partition("=")
        fld = _FLAG_OF.get(name)
        takes_value = MODELLED[fld][1] if fld else name not in NEUTRAL_SWITCHES
        if name not in _FLAG_OF and name not in NEUTRAL_VALUE_FLAGS and name not in NEUTRAL_SWITCHES:
            # unknown: take the next token as its value unless it is another flag
            if not eq and i < len(argv) and not argv[i].startswith("--"):
                inline, i = argv[i], i + 1
            unknown.append(f"{name} {inline}".strip() if inline else name)
            continue
        value: Any = True
        if takes_value:
            if eq:
                value = inline
            elif i < len(argv) and not argv[i].startswith("--"):
                value, i = argv[i], i + 1
            else:
                raise SGLangArgsError(f"{name} expects a value")
        if fld is None:
            neutral.append(name)
            continue
        values[fld] = value
        given[fld] = name if value is True else f"{name} {value}"
    return values, given, unknown, neutral


def _int(values: dict, fld: str, default: int | None) -> int | None:
    v = values.get(fld, default)
    if v is None or isinstance(v, int):
        return v
    try:
        return int(v)
    except (TypeError, ValueError):
        raise SGLangArgsError(f"{MODELLED[fld][0][0]}: expected an integer, got {v!r}") from None


def _bool_env(env: dict[str, str], name: str) -> bool:
    v = env.get(name)
    if v is None:
        return False
    if v.lower() in ("true", "1", "yes", "y"):
        return True
    if v.lower() in ("false", "0", "no", "n"):
        return False
    raise SGLangArgsError(f'{name}={v}: "{v}" is not a valid boolean value (SGLang reads true/1/yes/y or false/0/no/n)')


def read_model_config(model_path: str | None, model_config: str | None) -> tuple[dict, str]:
    """The model's ``config.json`` fields and where they came from."""
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
    if model_path is None or FLASH.lower() in model_path.lower():
        return builtin_flash_config(), f"built-in {FLASH} layout"
    raise SGLangArgsError(
        f"cannot tell the layer layout of model {model_path!r}: give its config.json with --model-config PATH "
        f"(built in: {FLASH})"
    )


def apply_model_config(side_kw: dict, cfg: dict, source: str, overrides: dict, override_flag: str) -> list[str]:
    """Fill the layout fields from ``cfg`` then ``overrides``; returns the override keys not modelled."""
    archs = cfg.get("architectures") or []
    if archs and archs[0] != ARCH:
        raise SGLangArgsError(f"{source}: architecture {archs[0]} is not {ARCH} (pdstate models DeepSeek-V4)")
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
