"""Reading one SGLang launch: the arguments as operators write them (``VAR=value`` tokens, a
launcher, ``--flags``), ``@path`` files, a running server's ``/get_server_info``, SGLang's
``--config`` YAML merged, and SGLang's own parser over the result (``parse_argv``). What is modelled
of what is read is ``coverage``; the model's ``config.json`` is ``model``; the prediction over it
all is ``prediction``."""

from __future__ import annotations

import json
import re
import shlex
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pdstate.errors import SGLangArgsError
from pdstate.inputs import read_input_file
from pdstate.integrations.sglang import releases

# Modules that run SGLang's server on SGLang's own arguments (``python -m MODULE ARGS``).
ENTRY_MODULES = ("sglang.launch_server", "pdstate.integrations.sglang.launch_server", "dynamo.sglang")
# Flags an entry point takes itself, beside SGLang's (Dynamo's SGLang worker: ``--dyn-*``).
_ENTRY_OWN = {"dynamo.sglang": "--dyn-"}
_SHELL_STOP = ("|", "||", "&&", ";", "&")
_BLOCK_OPEN = frozenset({"if", "case", "for", "while", "until"})
_BLOCK_CLOSE = frozenset({"fi", "esac", "done"})
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
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
    entry_flags: list[str] = field(default_factory=list)  # the entry point's own flags (Dynamo's --dyn-*)
    wrapper_env: dict[str, str] = field(default_factory=dict)  # what the wrapper's flags set (docker -e)
    model_names: list[str] = field(default_factory=list)  # other names of the model (a recipe's alias)


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
    launch.wrapper_env = launcher_env(tokens[:prog])
    launch.env.update(launch.wrapper_env)
    own = _ENTRY_OWN.get(tokens[args - 1])
    if own:
        launch.argv, launch.entry_flags = _take_flags(launch.argv, own)


# A launcher's flags that set the server's environment: container runtimes' ``-e``/``--env``,
# MPI's ``-x``; Slurm's ``--export=A,B=v`` items with a value; ``env VAR=v`` inside the launcher.
_ENV_FLAGS = {"-e": "container", "--env": "container", "-x": "mpi"}


def launcher_env(words: list[str]) -> dict[str, str]:
    """The environment variables a wrapper before SGLang's entry point gives the server."""
    env: dict[str, str] = {}
    i = 0
    while i < len(words):
        word = words[i]
        flag, eq, inline = word.partition("=")
        if flag in _ENV_FLAGS:
            value = inline if eq else (words[i + 1] if i + 1 < len(words) else "")
            i += 1 if eq else 2
            if _ENV_RE.match(value):
                k, v = value.split("=", 1)
                env[k] = v
            continue
        if flag == "--export" and eq:
            env.update(item.split("=", 1) for item in inline.split(",") if _ENV_RE.match(item))
        elif Path(word).name == "env":
            while i + 1 < len(words) and _ENV_RE.match(words[i + 1]):
                k, v = words[i + 1].split("=", 1)
                env[k] = v
                i += 1
        i += 1
    return env


def _take_flags(argv: list[str], prefix: str) -> tuple[list[str], list[str]]:
    """``(argv without the flags starting with prefix and their values, those flags)``."""
    rest: list[str] = []
    taken: list[str] = []
    i = 0
    while i < len(argv):
        if not argv[i].startswith(prefix):
            rest.append(argv[i])
            i += 1
            continue
        taken.append(argv[i])
        i += 1
        while "=" not in taken[-1].split(" ")[0] and i < len(argv) and not argv[i].startswith("-"):
            taken[-1] += f" {argv[i]}"
            i += 1
    return rest, taken


def read_launch(text: str, base_dir: Path | None = None) -> Launch:
    """One launch as operators write it: a line of arguments (``VAR=value`` first), or a script with
    ``export VAR=...`` lines, ``VAR=... cmd`` prefixes, ``\\`` continuations, ``$VAR`` expansions and
    other commands around SGLang's (``sglang serve``, ``python -m sglang.launch_server``, a wrapper)."""
    launch = Launch(base_dir=base_dir)
    variables: dict[str, str] = {}
    commands: list[list[str]] = []
    depth, conditional = 0, []  # shell blocks (if/case/for/while) around the line; exports in them
    joined = re.sub(r"\\\r?\n", " ", text)
    for raw in joined.splitlines():
        tokens = _split(_expand(raw, {**variables, **launch.env}))
        if not tokens:
            continue
        words = {t.rstrip(";") for t in tokens}
        opened = tokens[0] in _BLOCK_OPEN and not words & _BLOCK_CLOSE
        if tokens[0] in _BLOCK_CLOSE:
            depth = max(depth - 1, 0)
        depth += opened
        if tokens[0] == "export":
            for t in tokens[1:]:
                if "=" in t:
                    k, v = t.split("=", 1)
                    launch.env[k] = variables[k] = v
                elif t in variables:  # export of a variable set before
                    launch.env[t] = variables[t]
                if depth and t.split("=", 1)[0] in launch.env:
                    conditional.append(t.split("=", 1)[0])
            continue
        if all(_ENV_RE.match(t) for t in tokens):  # shell variables: not in SGLang's environment
            variables.update(t.split("=", 1) for t in tokens)
            continue
        if tokens[0] in _BLOCK_OPEN | _BLOCK_CLOSE | {"else", "elif", "then", "do", "esac", ";;"}:
            continue  # the shell's block structure, not a command
        commands.append(tokens)
    chosen = next((c for c in commands if _entry_at(c) is not None), None)
    if chosen is None:
        chosen = next((c for c in commands if any(t.startswith("--") for t in c)), None)
    if chosen is None:
        chosen = commands[0] if commands else []
    _command(chosen, launch)
    if conditional:
        names = ", ".join(dict.fromkeys(conditional))
        launch.notes.append(
            f"export lines inside shell blocks (if/case/for) read as if they ran: {names} "
            "(the last value written wins; check the branch your deployment takes)"
        )
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


def yaml_module():
    try:
        import yaml
    except ImportError:  # pragma: no cover (a dependency)
        raise SGLangArgsError("reading YAML (--config, --recipe) needs pyyaml: pip install pyyaml") from None
    return yaml


MAX_YAML_NODES = 100_000  # a YAML document's values once its aliases are expanded (a recipe: a few hundred)


def read_text(path: str | Path, what: str) -> str:
    """The text of the regular file ``path`` (``pdstate.inputs``: at most 16 MiB, never a FIFO, a
    device or a directory, each refused before it is opened or read), or ``SGLangArgsError``
    ``WHAT: why``."""
    data = read_input_file(path, unreadable=lambda why: f"{what}: {why}", error=SGLangArgsError)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SGLangArgsError(f"{what}: not UTF-8 text (byte {exc.start})") from None


def load_yaml(text: str, what: str):
    """``yaml.safe_load(text)``, refused with ``SGLangArgsError`` when its aliases expand to more
    than ``MAX_YAML_NODES`` values or an alias refers to a node that holds it (an alias bomb: 710
    bytes grew ``pdstate check`` to 2 GB). Aliases themselves are fine (``<<: *base``)."""
    loader = yaml_module().SafeLoader(text)
    try:
        node = loader.get_single_node()  # aliases share their node: the graph is as small as the text
        if node is None:
            return None
        _expanded_size(node, {}, set(), what)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_size(node, sizes: dict[int, int], open_: set[int], what: str) -> int:
    """The values ``node`` stands for with every alias expanded (each shared node counted once per
    reference, computed once)."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        raise SGLangArgsError(f"{what}: a YAML alias refers to a node that holds it; write the values out")
    open_.add(key)
    value = node.value
    children = value if isinstance(value, list) else ()
    n = 1
    for child in children:
        for part in child if isinstance(child, tuple) else (child,):  # a mapping's (key, value)
            n += _expanded_size(part, sizes, open_, what)
        if n > MAX_YAML_NODES:
            raise SGLangArgsError(
                f"{what}: its YAML aliases expand to more than {MAX_YAML_NODES} values; write the values out"
            )
    open_.discard(key)
    sizes[key] = n
    return n


def _config_keys(a: dict, release: str) -> set[str]:
    """The YAML keys SGLang's ``--config`` reads for one action (``config_long_keys``: any long spelling)."""
    keys = {a["dest"]}
    if releases.row(release).config_long_keys:
        keys |= {f[2:].replace("-", "_") for f in a["flags"] if f.startswith("--")}
    return keys


def config_to_argv(data: dict, release: str) -> list[str]:
    """SGLang's ``--config`` YAML mapping as the arguments SGLang's merger makes of it."""
    from pdstate.integrations.sglang.launch import argtable

    every_non_store = releases.row(release).config_refuses_every_non_store
    store_true: set[str] = set()
    unsupported: dict[str, str] = {}
    for a in argtable.actions(release):
        keys = _config_keys(a, release)
        if a["kind"] == "store_true":
            store_true |= keys
        elif a["kind"] != "store" and (every_non_store or a["nargs"] is not None):
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
    text = read_text(path, f"--config {name}")
    try:
        data = load_yaml(text, f"--config {name}")
    except SGLangArgsError:
        raise
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


def parse_argv(argv: list[str], release: str | None = None):
    """SGLang's arguments as SGLang ``release``'s own parser reads them (default the newest release;
    ``argtable.parse``): an ``argtable.Parsed`` plus the errors SGLang stops at (the refused argument is dropped and the rest
    read on, so one error does not hide the others)."""
    from pdstate.integrations.sglang.launch import argtable

    release = release or releases.newest().version
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
