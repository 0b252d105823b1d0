"""The transfer engines by name, and what the layers above need to know of each (standard library only).

An engine is its module (a ``TransferEngine`` subclass) plus one ``EngineEntry`` here. Every place
that names engines reads this table: configuration (``transfer.engine``'s accepted names), the
open-listener rule (``settings.auth``), SGLang's backend (which engines reach its private pools),
serve's decode (pools in ``/dev/shm`` or private), the CLI's choices. Importing this module imports
no engine, no numpy and no torch: the class is imported when an engine is first built
(``base.engine_class``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ENGINES", "EngineEntry", "engine_entry", "engine_names", "register_engine", "unregister_engine"]


@dataclass(frozen=True)
class EngineEntry:
    module: str  # the module defining the engine's class
    class_name: str
    extra: str | None = None  # the pip extra that provides its native package (pdstate[extra]), if any
    # its native side listens on every interface and authenticates nobody: a worker starts it only
    # when the operator acknowledged it (``transfer.<name>.allow_open_listener``, ``settings.auth``)
    open_listener: bool = False
    # the decode's memory must be a /dev/shm segment the prefill maps (one host): serve's decode
    # builds its pools there; SGLang's pools (private memory) cannot use it
    shared_memory: bool = False
    in_process: bool = False  # both sides in one process only (tests): not for serve, demo or bench


ENGINES: dict[str, EngineEntry] = {
    "shm": EngineEntry("pdstate.transfer.engines.shm", "ShmEngine", shared_memory=True),
    "loopback": EngineEntry("pdstate.transfer.engines.loopback", "LoopbackEngine", in_process=True),
    "mooncake": EngineEntry("pdstate.transfer.engines.mooncake", "MooncakeEngine", "mooncake", open_listener=True),
    "nixl": EngineEntry("pdstate.transfer.engines.nixl", "NixlEngine", "nixl", open_listener=True),
}


def engine_entry(name: str) -> EngineEntry:
    """``name``'s entry; ``KeyError`` for a name not registered."""
    return ENGINES[name]


def engine_names(*, in_process: bool | None = None, shared_memory: bool | None = None) -> tuple[str, ...]:
    """The registered names, in registration order, with the traits asked for (``None``: either)."""
    return tuple(
        name
        for name, e in ENGINES.items()
        if (in_process is None or e.in_process == in_process)
        and (shared_memory is None or e.shared_memory == shared_memory)
    )


def register_engine(name: str, entry: EngineEntry) -> None:
    """Add an engine under a new ``name`` (``ValueError`` if the name is taken)."""
    if name in ENGINES:
        raise ValueError(f"transfer engine {name!r} is already registered")
    ENGINES[name] = entry


def unregister_engine(name: str) -> None:
    """Remove ``name`` (a test's engine); the built-in engines stay."""
    ENGINES.pop(name, None)
