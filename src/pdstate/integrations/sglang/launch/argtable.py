"""SGLang's own launch-argument parser, per release, rebuilt from its extracted table.

``args-<release>.json`` beside this module (the release's row names it: ``releases``) is SGLang's ``ServerArgs.add_cli_args`` table as
``pdstate.devtools.sglang_args`` read it from that release (no SGLang needed here). ``parse`` runs
Python's argparse over it, so a launch is read exactly as SGLang reads it: unique prefixes of long
flags (argparse's ``allow_abbrev``: ``--speculative-algo EAGLE``), ``nargs`` (``--cuda-graph-bs 8 16
32``), switches, ``--no-`` booleans, choices, value types, and SGLang's deprecated spellings; a
deprecated flag that SGLang refuses, an ambiguous prefix, a bad choice or value is what stops
SGLang at start. What it does not know is returned as unknown (SGLang itself would exit with
"unrecognized arguments").
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from pdstate.errors import SGLangArgsParseError
from pdstate.integrations.sglang import releases


@dataclass
class Parsed:
    values: dict[str, Any] = field(default_factory=dict)  # dest -> value, only what was given
    given: dict[str, str] = field(default_factory=dict)  # dest -> the flag as written (+ value)
    unknown: list[str] = field(default_factory=list)  # what SGLang's parser does not know
    deprecated: list[str] = field(default_factory=list)  # SGLang's deprecation warnings
    error: str | None = None  # SGLang's parser refuses the arguments


@functools.cache
def table(release: str) -> dict:
    return json.loads(releases.row(release).args_path.read_text())


def _human_readable_int(value: str) -> int:
    """SGLang's ``human_readable_int``: plain integers, SI (k, M, G, T, decimals allowed) and IEC
    (Ki, Mi, Gi, Ti) suffixes."""
    value = value.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", value)
    if m is None:
        return int(value)
    num, suffix = m.groups()
    if suffix.endswith("i"):
        if "." in num:
            raise ValueError(f"decimals are not allowed with {suffix}")
        return int(num) * 2 ** (10 * ("KMGT".index(suffix[0]) + 1))
    return int(float(num) * 10 ** (3 * ("kMGT".index(suffix) + 1)))


def _nullable_str(value: str) -> str | None:
    return None if value.lower() in ("null", "none", "") else value


_TYPES = {
    "int": int,
    "float": float,
    "str": str,
    "json": json.loads,
    "json_list_type": json.loads,
    "human_readable_int": _human_readable_int,
    "nullable_str": _nullable_str,
}


def _typed(name: str | None):
    if name is None:
        return None
    fn = _TYPES.get(name, str)
    if fn is str:
        return None
    wrapper = functools.partial(fn)
    wrapper.__name__ = name  # argparse names the type in its "invalid ... value" message
    return wrapper


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's hook: raise instead of exiting
        raise SGLangArgsParseError(f"{self.prog}: error: {message}")


def _record(namespace, action: argparse.Action, option_string: str | None, values) -> None:
    seen = namespace.__dict__.setdefault("_pdstate_seen", [])
    seen.append((action.dest, option_string, values))


def _make(base: type) -> type:
    class Recorded(base):
        def __call__(self, parser, namespace, values, option_string=None):
            _record(namespace, self, option_string, values)
            super().__call__(parser, namespace, values, option_string)

    return Recorded


_Store = _make(argparse._StoreAction)
_StoreTrue = _make(argparse._StoreTrueAction)
_StoreFalse = _make(argparse._StoreFalseAction)
_StoreConst = _make(argparse._StoreConstAction)
_Append = _make(argparse._AppendAction)
_BoolOpt = _make(argparse.BooleanOptionalAction)


class _Deprecated(argparse.Action):
    """SGLang's ``DeprecatedAction``: with a message it stops the launch, else it warns."""

    def __init__(self, option_strings, dest, error_message=None, nargs=0, **kw):
        self.error_message = error_message
        super().__init__(option_strings, dest, nargs=nargs, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        if self.error_message is not None:
            parser.error(self.error_message)
        namespace.__dict__.setdefault("_pdstate_deprecated", []).append(
            f"{option_string} is deprecated in SGLang (a warning; it does nothing)"
        )


class _DeprecatedSet(argparse.Action):
    """SGLang's deprecated switches and renamed flags: the value goes to the new field, with a warning."""

    def __init__(self, option_strings, dest, new_flag=None, fixed=None, nargs=None, **kw):
        self.new_flag, self.fixed = new_flag, fixed
        super().__init__(option_strings, dest, nargs=nargs, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.fixed[0] if self.fixed is not None else values
        _record(namespace, self, option_string, value)
        setattr(namespace, self.dest, value)
        instead = f" (use {self.new_flag})" if self.new_flag else ""
        namespace.__dict__.setdefault("_pdstate_deprecated", []).append(
            f"{option_string} is deprecated in SGLang{instead}"
        )


def _add(parser: argparse.ArgumentParser, a: dict) -> None:
    kind, flags = a["kind"], list(a["flags"])
    kw: dict[str, Any] = {"dest": a["dest"], "default": argparse.SUPPRESS}
    choices = a.get("choices")
    if a["dest"] == "disaggregation_transfer_backend" and choices is not None and "pdstate" not in choices:
        choices = [*choices, "pdstate"]  # pdstate's install adds its backend to SGLang's choices
    typ = _typed(a.get("type"))
    if kind in ("store", "append"):
        kw.update(nargs=a["nargs"], type=typ, choices=choices, action=_Store if kind == "store" else _Append)
    elif kind == "store_true":
        kw.update(action=_StoreTrue)
    elif kind == "store_false":
        kw.update(action=_StoreFalse)
    elif kind == "store_const":
        kw.update(action=_StoreConst, const=a.get("const"))
    elif kind == "boolean_optional":
        flags = [f for f in flags if not f.startswith("--no-")]
        kw.update(action=_BoolOpt)
    elif kind == "deprecated":
        kw.update(action=_Deprecated, nargs=a["nargs"], error_message=a.get("error_message"))
    elif kind == "deprecated_store_true":
        kw.update(action=_DeprecatedSet, nargs=0, new_flag=a.get("new_flag"), fixed=(True,))
    elif kind == "deprecated_store_const":
        kw.update(
            action=_DeprecatedSet,
            nargs=a["nargs"],
            new_flag=a.get("new_flag"),
            choices=choices,
            fixed=(a.get("const_value"),),
        )
    elif kind == "deprecated_alias":
        kw.update(action=_DeprecatedSet, nargs=a["nargs"], type=typ, choices=choices, new_flag=a.get("new_flag"))
    else:  # an action this module does not know: take its values as SGLang's nargs says
        kw.update(nargs=a["nargs"], action=_Store)
    parser.add_argument(*flags, **kw)


@functools.cache
def parser(release: str) -> argparse.ArgumentParser:
    t = table(release)
    p = _Parser(prog=t["prog"], allow_abbrev=t["allow_abbrev"], add_help=False)
    for a in t["actions"]:
        _add(p, a)
    return p


def actions(release: str) -> list[dict]:
    return table(release)["actions"]


@functools.cache
def store_true_dests(release: str) -> frozenset[str]:
    return frozenset(a["dest"] for a in actions(release) if a["kind"] == "store_true")


def known_long_flags(release: str) -> frozenset[str]:
    return frozenset(f for a in actions(release) for f in a["flags"])


def _show(flag: str, value: Any) -> str:
    if value is True or value == [] or value is None:
        return flag
    if isinstance(value, list):
        return " ".join([flag, *map(str, value)])
    return f"{flag} {value}"


def parse(argv: list[str], release: str) -> Parsed:
    """``argv`` as SGLang ``release``'s parser reads it."""
    out = Parsed()
    try:
        ns, extras = parser(release).parse_known_args(list(argv))
    except SGLangArgsParseError as exc:
        out.error = str(exc)
        return out
    seen = ns.__dict__.pop("_pdstate_seen", [])
    out.deprecated = ns.__dict__.pop("_pdstate_deprecated", [])
    for dest, option, value in seen:
        out.given[dest] = _show(option, value)
    for dest, value in vars(ns).items():
        out.values[dest] = value
    i = 0
    while i < len(extras):  # group an unknown flag with the words after it
        tok, i = extras[i], i + 1
        words = [tok]
        if tok.startswith("-") and "=" not in tok:
            while i < len(extras) and not extras[i].startswith("-"):
                words.append(extras[i])
                i += 1
        out.unknown.append(" ".join(words))
    return out
