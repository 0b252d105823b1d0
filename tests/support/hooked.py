"""Fault injection through the engine registry, not through an agent's private attributes: an
engine registered under another name (``hooked-loopback``, ``hooked-shm``) that is the real engine
plus a ``Hooks`` object the test holds.

    with hooked("loopback") as hooks:
        pa = PrefillAgent(..., engine=hooks.engine, engine_options=hooks.options())
        hooks.after_submit = lambda plan: ...   # runs right after each real submit
        hooks.engines[0].num_peers               # the engine the agent built (its public surface)

The engine keeps its base's ``name``, so the handshake and the peer's engine see the base engine
(a ``loopback`` decode pairs with a ``hooked-loopback`` prefill).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from pdstate.transfer.engines import EngineEntry, register_engine, unregister_engine
from pdstate.transfer.engines.loopback import LoopbackEngine
from pdstate.transfer.engines.shm import ShmEngine
from pdstate.transfer.plan import TransferPlan

_HOOKS: dict[str, Hooks] = {}
_IDS = itertools.count(1)


@dataclass
class Hooks:
    """What a test does around the engine an agent built: ``after_submit(plan)`` right after the
    engine started writing each non-empty plan (inside ``submit``; the loopback engine without a
    delay has copied it by then); ``submits``: every plan ``submit`` was asked to move, empty ones
    included; ``engines``: each engine built under this name, in order."""

    engine: str
    key: str
    after_submit: Callable[[TransferPlan], None] | None = None
    submits: list = field(default_factory=list)
    engines: list = field(default_factory=list)

    def options(self, **more) -> dict:
        """The ``engine_options`` that tie the built engine to these hooks."""
        return {"hooks": self.key, **more}


class _Hooked:
    """The hook points, mixed in front of a real engine class."""

    def _bind(self, key: str) -> None:
        self.hooks = _HOOKS[key]
        self.hooks.engines.append(self)

    def submit(self, peer_id, plan, notify=b"", **more):
        self.hooks.submits.append(plan)
        return super().submit(peer_id, plan, notify, **more)

    def _submit(self, peer, plan, handle, notify) -> None:
        super()._submit(peer, plan, handle, notify)
        if self.hooks.after_submit is not None:
            self.hooks.after_submit(plan)


class HookedLoopbackEngine(_Hooked, LoopbackEngine):
    def __init__(self, hooks: str, **options) -> None:
        super().__init__(**options)
        self._bind(hooks)


class HookedShmEngine(_Hooked, ShmEngine):
    def __init__(self, hooks: str, **options) -> None:
        super().__init__(**options)
        self._bind(hooks)


_CLASSES = {"loopback": ("HookedLoopbackEngine", True), "shm": ("HookedShmEngine", False)}


@contextmanager
def hooked(base: str = "loopback") -> Iterator[Hooks]:
    """Register ``hooked-<base>`` (once per use) and yield its ``Hooks``; unregistered after."""
    class_name, in_process = _CLASSES[base]
    key = f"hooked-{base}-{next(_IDS)}"
    hooks = _HOOKS[key] = Hooks(engine=key, key=key)
    register_engine(key, EngineEntry(__name__, class_name, shared_memory=base == "shm", in_process=in_process))
    try:
        yield hooks
    finally:
        unregister_engine(key)
        _HOOKS.pop(key, None)
