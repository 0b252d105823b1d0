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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any  # noqa: F401

from pdstate.errors import SGLangArgsError

ARCH = "DeepseekV4ForCausalLM"
FLASH = "DeepSeek-V4-Flash"
SPEC_DEFAULTS = (3, 1, 4)  # SGLang's auto-chosen (steps, topk, draft tokens) for DeepSeek models

PRO = "DeepSeek-V4-Pro"
NEWEST = "0.5.23"  # the newest SGLang release pdstate models (``prediction.SUPPORTED_RELEASES[-1]``)

# ServerArgs fields the prediction reads (SGLang's ``dest`` names; its parser gives the flags).
MODELLED = frozenset(
    """model_path page_size kv_cache_dtype speculative_algorithm speculative_num_steps speculative_eagle_topk
    speculative_num_draft_tokens speculative_draft_model_path speculative_draft_kv_cache_dtype disaggregation_mode
    disaggregation_transfer_backend tp_size dp_size enable_dp_attention attn_dp_size pp_size attn_cp_size dcp_size
    json_model_override_args device attention_backend enable_hisparse enable_deepseek_v4_fp4_indexer enable_prefill_cp
    disaggregation_decode_enable_radix_cache config""".split()
)
# Layout-neutral fields that SGLang's start-time rules read (counted as neutral, passed to the rules).
RULE_INPUTS = frozenset({"enable_dp_lm_head"})
# Fields whose names say they may touch the DSV4 state layout: listed as "not modelled" when given,
# unless NEUTRAL below says otherwise. Every other field SGLang knows sizes pools, picks kernels,
# serves HTTP or logs: counted as layout-neutral.
_LAYOUT_HINT = re.compile(
    r"kv_cache|kv_layout|dsv4|dsa_|nsa_|hisparse|c128|compress|indexer|swa|draft|eagle|dspark|speculative|"
    r"page_major|kv_canary|linker|sharding|prefill_cp|context_parallel|cp_strategy|cp_mode|revision|kv_layer"
)
NEUTRAL = frozenset(
    """swa_full_tokens_ratio speculative_accept_threshold_acc speculative_accept_threshold_single
    speculative_moe_a2a_backend speculative_moe_runner_backend speculative_draft_load_format
    speculative_draft_model_quantization speculative_attention_mode speculative_skip_dp_mlp_sync
    speculative_use_rejection_sampling speculative_adaptive speculative_adaptive_config
    speculative_enable_w4a4_mxfp4_megamoe speculative_draft_attention_backend speculative_dsa_topk_backend
    enable_draft_weights_cpu_backup kv_canary_sweep_interval kv_canary_real_data disable_hybrid_swa_memory
    dsv4_prefill_backend enable_decoder_swa_bounded_replay enable_encoder_swa_bounded_replay""".split()
)
# Environment variables the prediction reads.
MODELLED_ENV = (
    "SGLANG_OPT_USE_ONLINE_COMPRESS",
    "SGLANG_EXPERIMENTAL_ONLINE_C128_MTP",
    "SGLANG_DSV4_COMPRESS_STATE_DTYPE",
    "SGLANG_HACK_FLASHMLA_BACKEND",
)
# Variables SGLang reads that do not touch the layout: transport, timeouts, logging, kernels, MoE,
# scheduling. Anything not SGLang's (no SGLANG_/SGL_ prefix) is not read by SGLang for the layout.
NEUTRAL_ENV_PREFIXES = (
    "SGLANG_DISAGGREGATION_",
    "SGLANG_LOG",
    "SGLANG_TORCH_PROFILER",
    "SGLANG_PROFILE",
    "SGLANG_DUMPER",
    "SGLANG_EXPERT_DISTRIBUTION",
    "SGLANG_MOONCAKE_",
    "SGLANG_DEEPEP_",
    "SGLANG_FLASHINFER_",
    "SGLANG_JIT_DEEPGEMM",
    "SGLANG_ENABLE_JIT_DEEPGEMM",
    "SGLANG_MOE_",
    "SGLANG_NCCL",
    "SGLANG_OPT_SWA_",  # radix-tree eviction of SWA pages: which pages live, not how they are laid out
    "SGL_DG_",
    "SGL_JIT_",
    "SGL_ENABLE_JIT_DEEPGEMM",
)
NEUTRAL_ENV = frozenset(
    """SGLANG_HOST_IP SGLANG_LOCAL_IP_NIC SGLANG_PORT SGLANG_USE_MESSAGE_QUEUE_BROADCASTER SGLANG_SET_CPU_AFFINITY
    SGLANG_REQUEST_STATE_WAIT_TIMEOUT SGLANG_DEFAULT_THINKING SGLANG_DSV4_REASONING_EFFORT
    SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION SGLANG_RADIX_FORCE_MISS SGLANG_HACK_SEQ_BOOTSTRAP_ROOM
    SGLANG_NVFP4_CKPT_FP8_GEMM_IN_ATTN SGLANG_PER_TOKEN_GROUP_QUANT_8BIT_V2 SGLANG_ENABLE_SPEC_V2
    SGLANG_ENABLE_OVERLAP_PLAN_STREAM SGLANG_PLUGINS SGLANG_WATCHDOG_TIMEOUT
    SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK""".split()
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

_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def field_kind(dest: str) -> str:
    """``"modelled"``, ``"neutral"`` or ``"not modelled"`` for one of SGLang's ServerArgs fields."""
    if dest in MODELLED:
        return "modelled"
    if dest in NEUTRAL or not _LAYOUT_HINT.search(dest):
        return "neutral"
    return "not modelled"


def env_kind(name: str) -> str:
    """``"modelled"``, ``"neutral"`` or ``"not modelled"`` for one environment variable."""
    if name in MODELLED_ENV:
        return "modelled"
    if not name.startswith(("SGLANG_", "SGL_")) or name in NEUTRAL_ENV or name.startswith(NEUTRAL_ENV_PREFIXES):
        return "neutral"
    return "not modelled"


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

# Modules that run SGLang's server on SGLang's own arguments (``python -m MODULE ARGS``).
ENTRY_MODULES = ("sglang.launch_server", "pdstate.integrations.sglang.launch_server", "dynamo.sglang")
_SHELL_STOP = ("|", "||", "&&", ";", "&")
_VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


@dataclass
class Launch:
    """One SGLang server's launch as read: its environment, SGLang's arguments, what ran them."""

    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    launcher: str = ""  # a wrapper before SGLang's entry point, with its own flags (srun, numactl, ...)
    entry: str = ""  # "python3 -m sglang.launch_server", "sglang serve", ...
    notes: list[str] = field(default_factory=list)
    base_dir: Path | None = None  # where a relative --config path is also looked for


def _expand(line: str, variables: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if name in variables:
            return variables[name]
        if m.group(2) is not None:
            return m.group(2)
        return m.group(0)

    return _VAR_RE.sub(sub, line)


def _split(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError as exc:
        raise SGLangArgsError(f"cannot split the launch arguments: {exc}") from None


def _entry_at(tokens: list[str]) -> tuple[int, int] | None:
    """``(first word of the program, first of SGLang's arguments)`` of SGLang's entry point in ``tokens``."""
    for j, tok in enumerate(tokens):
        if tok == "-m" and j + 1 < len(tokens) and tokens[j + 1] in ENTRY_MODULES:
            return max(j - 1, 0), j + 2
        if tok.endswith("launch_server.py"):
            prog = j - 1 if j > 0 and Path(tokens[j - 1]).name.startswith("python") else j
            return prog, j + 1
        if Path(tok).name == "sglang" and j + 1 < len(tokens) and tokens[j + 1] == "serve":
            return j, j + 2
    return None


def _command(tokens: list[str], launch: Launch) -> None:
    """Fill ``launch`` from one command line's words (``VAR=value`` prefixes, a wrapper, the entry)."""
    i = 1 if tokens[:1] == ["env"] else 0
    while i < len(tokens) and _ENV_RE.match(tokens[i]):
        k, v = tokens[i].split("=", 1)
        launch.env[k] = v
        i += 1
    tokens = tokens[i:]
    for k, tok in enumerate(tokens):  # the shell's pipes and redirections end SGLang's arguments
        if tok in _SHELL_STOP or re.match(r"^[0-9]*>", tok):
            tokens = tokens[:k]
            break
    found = _entry_at(tokens)
    if found is None:  # no known entry point: SGLang's arguments start at the first --flag
        j = next((k for k, t in enumerate(tokens) if t.startswith("--")), len(tokens))
        launch.launcher, launch.argv = " ".join(tokens[:j]), tokens[j:]
        return
    prog, args = found
    launch.launcher, launch.entry, launch.argv = " ".join(tokens[:prog]), " ".join(tokens[prog:args]), tokens[args:]


def read_launch(text: str, base_dir: Path | None = None) -> Launch:
    """One launch as operators write it: a line of arguments (``VAR=value`` first), or a script with
    ``export VAR=...`` lines, ``VAR=... cmd`` prefixes, ``\\`` continuations, ``$VAR`` expansions and
    other commands around SGLang's (``sglang serve``, ``python -m sglang.launch_server``, a wrapper)."""
    launch = Launch(base_dir=base_dir)
    variables: dict[str, str] = {}
    commands: list[list[str]] = []
    joined = re.sub(r"\\\r?\n", " ", text)
    for raw in joined.splitlines():
        tokens = _split(_expand(raw, {**variables, **launch.env}))
        if not tokens:
            continue
        if tokens[0] == "export":
            for t in tokens[1:]:
                if "=" in t:
                    k, v = t.split("=", 1)
                    launch.env[k] = variables[k] = v
                elif t in variables:  # export of a variable set before
                    launch.env[t] = variables[t]
            continue
        if all(_ENV_RE.match(t) for t in tokens):  # shell variables: not in SGLang's environment
            variables.update(t.split("=", 1) for t in tokens)
            continue
        commands.append(tokens)
    chosen = next((c for c in commands if _entry_at(c) is not None), None)
    if chosen is None:
        chosen = next((c for c in commands if any(t.startswith("--") for t in c)), None)
    if chosen is None:
        chosen = commands[0] if commands else []
    _command(chosen, launch)
    skipped = len(commands) - (1 if chosen else 0)
    if skipped:
        launch.notes.append(f"{skipped} other command line{'s' if skipped != 1 else ''} of the script skipped")
    return launch


def split_launch(text: str) -> tuple[dict[str, str], list[str], str]:
    """``(environment, SGLang's arguments, what ran them)`` of one launch (``read_launch``)."""
    launch = read_launch(text)
    return launch.env, launch.argv, " ".join(w for w in (launch.launcher, launch.entry) if w)


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


def _yaml():
    try:
        import yaml
    except ImportError:  # pragma: no cover (a dependency)
        raise SGLangArgsError("reading YAML (--config, --recipe) needs pyyaml: pip install pyyaml") from None
    return yaml


def _config_keys(a: dict, release: str) -> set[str]:
    """The YAML keys SGLang's ``--config`` reads for one action (0.5.23: any long spelling)."""
    keys = {a["dest"]}
    if release != "0.5.19":
        keys |= {f[2:].replace("-", "_") for f in a["flags"] if f.startswith("--")}
    return keys


def config_to_argv(data: dict, release: str) -> list[str]:
    """SGLang's ``--config`` YAML mapping as the arguments SGLang's merger makes of it."""
    from pdstate.integrations.sglang.launch import argtable

    store_true: set[str] = set()
    unsupported: dict[str, str] = {}
    for a in argtable.actions(release):
        keys = _config_keys(a, release)
        if a["kind"] == "store_true":
            store_true |= keys
        elif a["kind"] != "store" and (release == "0.5.19" or a["nargs"] is not None):
            unsupported.update((k, a["kind"]) for k in keys)
    args: list[str] = []
    for key, value in data.items():
        norm = str(key).replace("-", "_")
        if norm in unsupported and norm not in store_true:
            raise SGLangArgsError(f"ValueError: Unsupported config option '{norm}' in SGLang's --config")
        if isinstance(value, bool):
            if norm in store_true:
                args += [f"--{key}"] if value else []
            else:
                args += [f"--{key}", str(value).lower()]
        elif isinstance(value, list):
            args += [f"--{key}", *map(str, value)] if value else []
        elif isinstance(value, dict):
            args += [f"--{key}", json.dumps(value)]
        else:
            args += [f"--{key}", str(value)]
    return args


def merge_config(argv: list[str], release: str, base_dir: Path | None) -> tuple[list[str], str | None]:
    """SGLang's ``--config FILE.yaml`` merged as SGLang merges it (its arguments first, so the
    command line wins): ``(arguments, the file read or None)``. Like SGLang, only the exact word
    ``--config`` is looked for."""
    idx = [i for i, t in enumerate(argv) if t == "--config"]
    if not idx:
        return argv, None
    if len(idx) > 1:
        raise SGLangArgsError("ValueError: Multiple config files specified! Only one allowed. (SGLang's --config)")
    i = idx[0]
    if i == len(argv) - 1:
        raise SGLangArgsError("ValueError: No config file specified after --config flag!")
    name = argv[i + 1]
    path = Path(name)
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise SGLangArgsError(f"--config {name}: ValueError: Config file must be YAML format, got: {path.suffix}")
    if not path.is_absolute() and not path.exists() and base_dir is not None and (base_dir / path).exists():
        path = base_dir / path
    try:
        data = _yaml().safe_load(path.read_text())
    except OSError as exc:
        raise SGLangArgsError(f"--config {name}: {exc.strerror or exc}") from None
    except Exception as exc:  # yaml's errors
        raise SGLangArgsError(f"--config {name}: not YAML: {exc}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise SGLangArgsError(f"--config {name}: ValueError: Config file must contain a dictionary at root level")
    return config_to_argv(data, release) + argv[:i] + argv[i + 2 :], str(path)


def _flag_of_error(message: str, argv: list[str]) -> int | None:
    """The index in ``argv`` of the argument SGLang's parser refused (to read on without it)."""
    m = re.search(r"(?:argument|ambiguous option:) (--[A-Za-z0-9-]+)", message)
    for k, tok in enumerate(argv):
        name = tok.split("=", 1)[0]
        if not name.startswith("--"):
            continue
        if (m and m.group(1).startswith(name)) or (not m and name in message):
            return k
    return None


def parse_argv(argv: list[str], release: str = NEWEST):
    """SGLang's arguments as SGLang ``release``'s own parser reads them (``argtable.parse``): an
    ``argtable.Parsed`` plus the errors SGLang stops at (the refused argument is dropped and the rest
    read on, so one error does not hide the others)."""
    from pdstate.integrations.sglang.launch import argtable

    errors: list[str] = []
    argv = list(argv)
    for _ in range(16):
        parsed = argtable.parse(argv, release)
        if parsed.error is None:
            parsed.error = "; ".join(errors) or None
            return parsed
        errors.append(parsed.error)
        k = _flag_of_error(parsed.error, argv)
        if k is None:
            break
        end = k + 1
        if "=" not in argv[k]:
            while end < len(argv) and not argv[end].startswith("--"):
                end += 1
        del argv[k:end]
    parsed = argtable.Parsed(error="; ".join(errors))
    return parsed


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
