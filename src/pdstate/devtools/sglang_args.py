"""Extract SGLang's own launch-argument table, once per release, into the data files
``pdstate check --sglang`` parses launches with (``pdstate/integrations/sglang/launch/args-<release>.json``).

``pdstate check`` must not need SGLang, so the table is read here from each release's real
``ServerArgs.add_cli_args`` (under the cached environments ``make sglang-env`` builds) and committed:

    python -m pdstate.devtools.sglang_args            # regenerate every release's file
    python -m pdstate.devtools.sglang_args --check    # exit 1 when a committed file is stale

Each action is kept with what argparse needs to parse as SGLang does: its option strings (argparse's
``allow_abbrev`` prefixes then work the same), ``dest``, the kind of action (store, store_true,
BooleanOptional, SGLang's deprecation actions), ``nargs``, ``const``, the value type by name,
``choices`` and the default (JSON-safe, else its ``repr``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD_FLAG = "--dump-in-this-env"


def data_path(release: str) -> Path:
    """Where ``release``'s table is committed (its row's ``args_path``)."""
    from pdstate.integrations.sglang import releases

    return releases.row(release).args_path


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        if isinstance(value, (set, frozenset, tuple)):
            return [_jsonable(v) for v in sorted(value, key=str)]
        return {"repr": repr(value)}


def _choices(choices):
    if choices is None:
        return None
    if isinstance(choices, (set, frozenset)):  # SGLang builds some from sets: no stable order
        return sorted(map(str, choices))
    return _jsonable(list(choices))


def _kind(action: argparse.Action) -> str:
    name = type(action).__name__
    known = {
        "_StoreAction": "store",
        "_StoreTrueAction": "store_true",
        "_StoreFalseAction": "store_false",
        "_StoreConstAction": "store_const",
        "_AppendAction": "append",
        "BooleanOptionalAction": "boolean_optional",
        "DeprecatedAction": "deprecated",
        "DeprecatedStoreTrueAction": "deprecated_store_true",
        "DeprecatedStoreConstAction": "deprecated_store_const",
        "DeprecatedAliasStoreAction": "deprecated_alias",
        "LoRAPathAction": "store",
        "_HelpAction": "help",
    }
    return known.get(name, f"other:{name}")


def _type_name(action: argparse.Action) -> str | None:
    t = action.type
    if t is None:
        return None
    if t in (int, float, str):
        return t.__name__
    name = getattr(t, "__name__", repr(t))
    return {"loads": "json"}.get(name, name)


def dump_parser() -> dict:
    """This environment's SGLang parser as data (run under the release's environment)."""
    import importlib

    importlib.import_module("pdstate.devtools.sglang_pair.booted")  # first: GPU-only imports stubbed
    sglang_version = importlib.import_module("sglang.version")
    server_args = importlib.import_module("sglang.srt.server_args")

    parser = argparse.ArgumentParser(prog="sglang serve")
    server_args.ServerArgs.add_cli_args(parser)
    actions = []
    for a in parser._actions:
        if not a.option_strings or _kind(a) == "help":
            continue
        entry = {
            "flags": list(a.option_strings),
            "dest": a.dest,
            "kind": _kind(a),
            "nargs": a.nargs,
            "const": _jsonable(a.const),
            "type": _type_name(a),
            "choices": _choices(a.choices),
            "default": _jsonable(a.default),
        }
        for extra in ("new_flag", "error_message", "const_value"):
            if getattr(a, extra, None) is not None:
                entry[extra] = _jsonable(getattr(a, extra))
        actions.append(entry)
    return {
        "release": sglang_version.__version__,
        "prog": parser.prog,
        "allow_abbrev": parser.allow_abbrev,
        "prefix_chars": parser.prefix_chars,
        "actions": actions,
    }


def render(table: dict) -> str:
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


def extract(release: str) -> str:
    """The table of ``release``, read by a child process under its cached environment."""
    from pdstate.devtools.sglang_pair.pair import child_env, env_dir

    target = env_dir(release)
    if not target.is_dir():
        raise FileNotFoundError(f"no cached SGLang {release} environment at {target} (make sglang-env)")
    done = subprocess.run(
        [sys.executable, "-m", "pdstate.devtools.sglang_args", CHILD_FLAG],
        env=child_env(target),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"SGLang {release}: extracting the argument table failed:\n{done.stderr[-3000:]}")
    table = json.loads(done.stdout.strip().splitlines()[-1])
    if table["release"] != release:
        raise RuntimeError(f"{target} holds SGLang {table['release']}, not {release}")
    return render(table)


def main(argv: list[str] | None = None) -> int:
    from pdstate.integrations.sglang import releases

    p = argparse.ArgumentParser(prog="python -m pdstate.devtools.sglang_args", description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    p.add_argument("--release", action="append", choices=releases.versions(), help="default: every release")
    p.add_argument(CHILD_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dump_in_this_env:
        print(json.dumps(dump_parser()))
        return 0
    stale = 0
    for release in args.release or releases.versions():
        text, path = extract(release), data_path(release)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                print(f"{path}: stale (regenerate: python -m pdstate.devtools.sglang_args --release {release})")
                stale += 1
        else:
            path.write_text(text)
            print(f"wrote {path}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
