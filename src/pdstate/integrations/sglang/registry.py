"""The patches ``install()`` applies to SGLang (imported here only when ``register()`` runs).

Each step is idempotent on its own, so a partly patched process (another copy of this module, a
retried install) ends in the same state.
"""

from __future__ import annotations

import functools
import importlib
import sys
from enum import Enum
from typing import Any

from pdstate.errors import SGLangUnavailable
from pdstate.integrations.sglang import releases

UTILS = "sglang.srt.disaggregation.utils"
SERVER_ARGS = "sglang.srt.server_args"
CHOICES = "DISAGG_TRANSFER_BACKEND_CHOICES"
BACKEND = "pdstate"  # the value of the TransferBackend member and of the command-line choice
MEMBER = "PDSTATE"  # the TransferBackend member's name
SUPPORTED_RELEASES = releases.versions()  # the SGLang releases the adapter is tested against (``releases``)
# The modules of SGLang (every release of ``releases``) that import get_kv_class by name (``from ...utils import get_kv_class``):
# patched when already loaded; loaded later, they bind the wrapper from ``utils``.
IMPORTERS = (
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.managers.disagg_service",
)
WRAPPED = "__pdstate_wrapped__"  # set on the wrapper: the function it wraps


def tested() -> str:
    """The releases the adapter is tested against, as an error says them."""
    return f"tested with sglang {releases.spelled()}"


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise SGLangUnavailable(
            f"pdstate's SGLang backend needs the module {name!r}, which cannot be imported: {exc}. "
            f"Install SGLang ({tested()}) in this environment."
        ) from exc


def _attr(module, name: str):
    try:
        return getattr(module, name)
    except AttributeError as exc:
        raise SGLangUnavailable(
            f"pdstate's SGLang backend needs {module.__name__}.{name}, which this SGLang does not have ({tested()})."
        ) from exc


def add_enum_member(cls: type[Enum], name: str, value: Any) -> Enum:
    """Add ``name = value`` to the closed enum ``cls`` (plain-``Enum`` members: no mixin type) so
    that ``cls(value)``, ``cls[name]``, ``cls.name``, iteration and ``len`` all see it."""
    existing = cls._value2member_map_.get(value)
    if existing is not None:
        if existing.name != name:
            raise ValueError(f"{cls.__name__}({value!r}) is already {existing!r}")
        return existing
    if name in cls._member_map_:
        raise ValueError(f"{cls.__name__}.{name} already exists with value {cls[name].value!r}")
    member = object.__new__(cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = cls
    if hasattr(cls._member_map_[cls._member_names_[0]], "_sort_order_"):  # Python >= 3.11
        member._sort_order_ = len(cls._member_names_)
    type.__setattr__(cls, name, member)  # EnumType.__setattr__ refuses to rebind member names
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    cls._member_names_.append(name)
    return member


def wrap_get_kv_class(original, classes: dict[Any, type], backend: Enum):
    """``get_kv_class`` answering pdstate's ``classes`` for ``backend`` (``KVARGS`` stays
    SGLang's: the original answers it, and every other backend)."""
    if getattr(original, WRAPPED, None) is not None:
        return original

    @functools.wraps(original)
    def get_kv_class(transfer_backend, class_type):
        if transfer_backend == backend and class_type in classes:
            return classes[class_type]
        return original(transfer_backend, class_type)

    setattr(get_kv_class, WRAPPED, original)
    return get_kv_class


def register() -> None:
    """Apply every patch (see the package docstring)."""
    utils = _module(UTILS)
    server_args = _module(SERVER_ARGS)
    transfer_backend = _attr(utils, "TransferBackend")
    kv_class_type = _attr(utils, "KVClassType")
    choices = _attr(server_args, CHOICES)
    original = _attr(utils, "get_kv_class")

    from pdstate.integrations.sglang.classes import build_classes

    kinds = {kind: _attr(kv_class_type, kind) for kind in ("MANAGER", "SENDER", "RECEIVER", "BOOTSTRAP_SERVER")}
    built = build_classes()
    classes = {kinds[kind]: cls for kind, cls in built.items()}

    member = add_enum_member(transfer_backend, MEMBER, BACKEND)
    if BACKEND not in choices:
        choices.append(BACKEND)
    wrapped = wrap_get_kv_class(original, classes, member)
    utils.get_kv_class = wrapped
    for module in list(sys.modules.values()):  # SGLang's importers, and any other module that took it by name
        if module is not None and getattr(module, "get_kv_class", None) is original:
            module.get_kv_class = wrapped
