"""The transfer-engine contract, the checks every engine shares, and the engine registry.

Model (RDMA-style one-sided writes). The DECODE side owns the destination memory: it ``start()``s
an engine, ``register()``s its regions and publishes ``endpoint()``, a msgpack-serialisable dict
(str/int/bytes/lists only). The PREFILL side ``start()``s its own engine, ``register()``s its
source regions, ``connect(endpoint)`` returns a peer id, and ``submit(peer_id, plan)`` writes
``plan.length[i]`` bytes from local address ``plan.src[i]`` to remote address ``plan.dst[i]``,
where remote addresses are the decode process's own virtual addresses as it registered them.

Contract of every engine (the suite in ``tests/engines`` runs unchanged over all of them):

* Constructors only store configuration; ``start()`` does IO and creates the native agent.
  ``close()`` releases everything and is idempotent; ``with engine:`` starts and closes.
* ``submit`` validates EVERY descriptor before moving any byte: ``src`` must lie inside a local
  registered region and ``dst`` inside one of the peer's published regions, otherwise
  ``DescriptorOutOfRange`` names the first bad descriptor's index and address and nothing is
  written. Zero-length descriptors are checked, then dropped. An empty plan completes at once.
* ``poll(handle)`` returns True once the transfer is done and raises ``EngineError`` if it
  failed (every later poll/wait raises the same error). ``wait(handle, timeout_s)`` blocks until
  done or raises: ``TransferTimedOut`` ("... timed out ...") past the deadline, else the failure.
  A failure the native library reports while posting (e.g. NIXL's remote-disconnect) is raised
  by ``submit`` itself; callers treat an ``EngineError`` from submit, poll or wait alike. Bytes
  of a failed transfer may be partly written.
* Public methods are serialised by one lock per engine, so a control thread may ``connect``
  while a worker thread submits and waits. ``wait`` holds the lock only while it polls, never
  while it sleeps; a transfer in flight on a native thread does not hold it.
* Endpoint fields shared by all engines: ``engine`` (the engine name), ``engine_id`` (random per
  ``start()``), ``regions`` (list of ``{"name", "base_ptr", "nbytes"}``). Engines add their own.

Engines implement the underscored hooks (``_start``, ``_register``, ``_endpoint_fields``,
``_connect``, ``_disconnect``, ``_submit``, ``_poll``, ``_close``); the public methods here do
the lifecycle checks and the plan validation once, so an adapter only maps a checked plan onto
its native API.
"""

from __future__ import annotations

import functools
import importlib
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from types import ModuleType
from typing import Any, ClassVar, TypeVar

from pdstate.errors import (
    EngineError,
    EngineStateError,
    EngineUnavailable,
    InvalidEndpoint,
    TransferTimedOut,
    UnknownPeer,
)
from pdstate.pools.memory import Region
from pdstate.transfer.engines.listeners import Transport, tcp_listeners
from pdstate.transfer.engines.regions import RegionTable, check_plan, drop_empty
from pdstate.transfer.engines.registry import ENGINES, EngineEntry
from pdstate.transfer.plan import TransferPlan

__all__ = [  # RegionTable, check_plan and drop_empty live in regions.py, ENGINES and EngineEntry in registry.py; re-exported here
    "ENGINES",
    "EngineEntry",
    "Peer",
    "RegionTable",
    "TransferEngine",
    "TransferHandle",
    "TransferStatus",
    "check_plan",
    "create_engine",
    "drop_empty",
    "engine_class",
    "import_native",
]

_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    @functools.wraps(method)
    def wrapper(self: TransferEngine, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class TransferStatus(Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class TransferHandle:
    """One submitted plan. ``native`` is the engine's private state (cleared when finished)."""

    __slots__ = ("peer_id", "num_descriptors", "total_bytes", "status", "error", "native")

    def __init__(self, peer_id: str, num_descriptors: int, total_bytes: int) -> None:
        self.peer_id = peer_id
        self.num_descriptors = num_descriptors
        self.total_bytes = total_bytes
        self.status = TransferStatus.PENDING
        self.error: EngineError | None = None
        self.native: Any = None

    def finish(self) -> None:
        self.status, self.native = TransferStatus.DONE, None

    def fail(self, error: EngineError) -> None:
        self.status, self.error, self.native = TransferStatus.FAILED, error, None

    def __repr__(self) -> str:
        return (
            f"TransferHandle(peer_id={self.peer_id!r}, num_descriptors={self.num_descriptors}, "
            f"total_bytes={self.total_bytes}, status={self.status.value})"
        )


def import_native(module: str, engine: str, extra: str) -> ModuleType:
    """Import an optional native package, or raise ``EngineUnavailable`` naming the extra."""
    try:
        return importlib.import_module(module)
    except (ImportError, OSError) as exc:
        raise EngineUnavailable(
            f"transfer engine {engine!r} is not available ({module} failed to import: {exc}); "
            f"install it with: pip install 'pdstate[{extra}]'"
        ) from exc


@dataclass
class Peer:
    """A connected peer: its published regions, the endpoint it came from, native state."""

    peer_id: str
    endpoint: Mapping[str, Any]
    regions: RegionTable
    native: Any = None
    owner: str | None = None  # who registered it (see ``TransferEngine.connect``)


class _Lifecycle(Enum):
    NEW = "new"
    STARTED = "started"
    CLOSED = "closed"


class TransferEngine(ABC):
    """Base of every engine; see the module docstring for the contract."""

    name: ClassVar[str]
    #: endpoint keys this engine needs besides the shared ``engine``/``engine_id``/``regions``
    endpoint_keys: ClassVar[tuple[str, ...]] = ()
    #: whether ``submit(..., notify=msg)`` and ``notifications()`` work
    supports_notify: ClassVar[bool] = False
    #: whether ``submit`` finishes the copy itself, in the caller's thread, without waiting on a
    #: peer or a network (so a small copy may run on a worker's control thread)
    synchronous: ClassVar[bool] = False
    #: whether ``connect`` needs proof that the registrant owns its memory (shm: ``challenge``/``prove``)
    proves_ownership: ClassVar[bool] = False

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._lifecycle = _Lifecycle.NEW
        self._engine_id = ""
        self._local = RegionTable()
        self._peers: dict[str, Peer] = {}

    # --- availability (registry) -------------------------------------------------------------

    @classmethod
    def check_available(cls) -> None:
        """Raise ``EngineUnavailable`` if the native package is missing. Pure-Python: no-op."""

    # --- lifecycle -----------------------------------------------------------------------------

    @_locked
    def start(self) -> None:
        """Create the native agent. Raises ``EngineError`` if it cannot be created."""
        if self._lifecycle is not _Lifecycle.NEW:
            raise EngineStateError(f"{self.name} engine: start() called twice or after close()")
        self._engine_id, before = secrets.token_hex(8), tcp_listeners()
        self._start()
        self._lifecycle, self._listening = _Lifecycle.STARTED, tuple(sorted(tcp_listeners() - before))

    def transport(self) -> Transport:
        """The transport configured and in use, and the listeners ``start`` opened (``engines.listeners``)."""
        return Transport(self.name, self.name, self.name, getattr(self, "_listening", ()))

    @_locked
    def close(self) -> None:
        """Release every native resource. Idempotent; safe before ``start()``."""
        if self._lifecycle is _Lifecycle.STARTED:
            try:
                self._close()
            finally:
                self._peers.clear()
        self._lifecycle = _Lifecycle.CLOSED

    def __enter__(self) -> TransferEngine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require_started(self, op: str) -> None:
        if self._lifecycle is not _Lifecycle.STARTED:
            state = "not started" if self._lifecycle is _Lifecycle.NEW else "closed"
            raise EngineStateError(f"{self.name} engine: {op}() called while {state}")

    # --- both sides ------------------------------------------------------------------------------

    @_locked
    def register(self, regions: Sequence[Region]) -> None:
        """Add regions (source on prefill, destination on decode). Regions must not overlap."""
        self._require_started("register")
        table = RegionTable.build([*self._local.regions, *regions])
        self._register(list(regions))
        self._local = table

    @property
    def regions(self) -> list[Region]:
        return self._local.regions

    # --- decode side ---------------------------------------------------------------------------

    @_locked
    def endpoint(self) -> dict:
        """What a prefill engine needs to ``connect``: a msgpack-serialisable dict."""
        self._require_started("endpoint")
        fields = self._endpoint_fields()
        return {"engine": self.name, "engine_id": self._engine_id, "regions": self._local.to_wire(), **fields}

    def prove(self, nonce: bytes, claimant: str) -> dict:
        """Endpoint fields answering a prefill's ``challenge(claimant)`` (``{}``: nothing to prove)."""
        return {}

    # --- prefill side --------------------------------------------------------------------------

    def challenge(self, claimant: str, holder: str = "") -> bytes:
        """A nonce decode ``claimant`` (``worker_id/incarnation``) answers with ``prove`` before
        ``connect``; ``holder``: the connection it came on (no other connection's register evicts it)."""
        raise EngineError(f"{self.name} engine does not challenge its peers")

    @_locked
    def connect(self, endpoint: Mapping[str, Any], owner: str | None = None) -> str:
        """Connect to a decode engine's endpoint; returns the peer id for ``submit``.

        ``owner``: who registered it (a decode's ``worker_id/incarnation``). A peer connected for
        one owner is never taken over, re-read or dropped by a connect for another: that raises
        ``InvalidEndpoint`` and leaves the existing peer as it was (an endpoint copied from a live
        decode cannot borrow its memory).

        Connecting again to the same engine returns the same id: with an identical endpoint the
        existing connection is kept as it is (a decode that registers again, the common case: no
        re-mapping, no new native session); with a changed one its regions are read again and
        the native state rebuilt. Raises ``InvalidEndpoint`` for a malformed/foreign endpoint,
        ``EngineError`` if the peer cannot be reached.
        """
        self._require_started("connect")
        if not isinstance(endpoint, Mapping) or endpoint.get("engine") != self.name:
            got = endpoint.get("engine") if isinstance(endpoint, Mapping) else type(endpoint).__name__
            raise InvalidEndpoint(f"{self.name} engine cannot connect to an endpoint of engine {got!r}")
        missing = [k for k in ("engine_id", "regions", *self.endpoint_keys) if k not in endpoint]
        if missing:
            raise InvalidEndpoint(f"{self.name} endpoint is missing {', '.join(missing)}")
        peer_id = f"{self.name}:{endpoint['engine_id']}"
        current = self._peers.get(peer_id)
        if current is not None and owner is not None and current.owner not in (None, owner):
            raise InvalidEndpoint(
                f"{self.name} endpoint {peer_id} does not belong to the registering decode: "
                "it is connected for another live decode"
            )
        if current is not None and current.endpoint == dict(endpoint):
            return peer_id
        old = self._peers.pop(peer_id, None)
        if old is not None:
            self._disconnect(old)
        peer = Peer(peer_id, dict(endpoint), RegionTable.from_wire(endpoint["regions"]), owner=owner)
        self._connect(peer)
        self._peers[peer_id] = peer
        return peer_id

    @_locked
    def disconnect(self, peer_id: str) -> bool:
        """Release one peer's native state (shm mappings, remote agent metadata).

        The caller must no longer wait on transfers to it; a later ``submit`` to the id raises
        ``UnknownPeer``. Returns False for an id that is not connected.
        """
        peer = self._peers.pop(peer_id, None)
        if peer is None:
            return False
        self._disconnect(peer)
        return True

    @_locked
    def peer_regions(self, peer_id: str) -> RegionTable:
        """The regions peer ``peer_id`` published (``UnknownPeer`` if not connected)."""
        return self._peer(peer_id).regions

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    @_locked
    def submit(self, peer_id: str, plan: TransferPlan, notify: bytes = b"") -> TransferHandle:
        """Validate the whole plan, then start writing it to the peer.

        ``notify``: a message the peer reads from its ``notifications()`` once the plan has
        landed; only engines with ``supports_notify`` accept a non-empty one.
        """
        self._require_started("submit")
        peer = self._peer(peer_id)
        if notify and not self.supports_notify:
            raise EngineError(f"{self.name} engine cannot deliver completion notifications")
        check_plan(plan, self._local, peer.regions)
        handle = TransferHandle(peer_id, len(plan), plan.total_bytes)
        plan = drop_empty(plan)
        if len(plan) == 0:
            if notify:
                self._notify(peer, bytes(notify))
            handle.finish()
            return handle
        self._submit(peer, plan, handle, bytes(notify))
        return handle

    @_locked
    def notifications(self) -> list[tuple[str, bytes]]:
        """Decode side: ``(sender, message)`` for each notification received since last call."""
        self._require_started("notifications")
        if not self.supports_notify:
            raise EngineError(f"{self.name} engine cannot deliver completion notifications")
        return self._notifications()

    @_locked
    def poll(self, handle: TransferHandle) -> bool:
        """True when done; False while in flight; raises the transfer's ``EngineError``."""
        if handle.status is TransferStatus.PENDING:
            self._require_started("poll")
            self._poll(handle)
        if handle.status is TransferStatus.FAILED:
            assert handle.error is not None
            raise handle.error
        return handle.status is TransferStatus.DONE

    def wait(self, handle: TransferHandle, timeout_s: float) -> None:
        """Block until done; raises ``TransferTimedOut`` after ``timeout_s``, or the failure."""
        deadline = time.monotonic() + timeout_s
        if handle.status is TransferStatus.PENDING:
            self._require_started("wait")
            self._wait(handle, deadline)
        if self.poll(handle):
            return
        raise TransferTimedOut(
            f"{self.name} transfer to {handle.peer_id} timed out after {timeout_s:g} s "
            f"({handle.num_descriptors} descriptors, {handle.total_bytes} bytes)"
        )

    def _peer(self, peer_id: str) -> Peer:
        try:
            return self._peers[peer_id]
        except KeyError:
            raise UnknownPeer(f"{self.name} engine has no peer {peer_id!r}: connect() first") from None

    # --- hooks ---------------------------------------------------------------------------------

    @abstractmethod
    def _start(self) -> None: ...

    def _register(self, regions: list[Region]) -> None:
        """Register with the native agent (regions already checked for overlap)."""

    def _endpoint_fields(self) -> dict:
        return {}

    @abstractmethod
    def _connect(self, peer: Peer) -> None: ...

    def _disconnect(self, peer: Peer) -> None:
        """Release a peer's native state (reconnect or close)."""

    @abstractmethod
    def _submit(self, peer: Peer, plan: TransferPlan, handle: TransferHandle, notify: bytes) -> None:
        """Start moving a checked, non-empty plan (then deliver ``notify`` if non-empty); may
        finish or fail the handle at once."""

    def _notify(self, peer: Peer, message: bytes) -> None:
        """Deliver a notification without data (empty plan); engines with ``supports_notify``."""
        raise NotImplementedError

    def _notifications(self) -> list[tuple[str, bytes]]:
        raise NotImplementedError

    def _poll(self, handle: TransferHandle) -> None:
        """Advance a pending handle: call ``handle.finish()`` or ``handle.fail(err)`` when known."""

    def _wait(self, handle: TransferHandle, deadline: float) -> None:
        """Poll until the handle leaves PENDING or the monotonic deadline passes."""
        pause_s = 20e-6
        while handle.status is TransferStatus.PENDING:
            with self._lock:
                self._require_started("wait")  # another thread may have closed the engine
                self._poll(handle)
            remaining_s = deadline - time.monotonic()
            if handle.status is not TransferStatus.PENDING or remaining_s <= 0:
                return
            time.sleep(min(pause_s, remaining_s))
            pause_s = min(pause_s * 2, 1e-3)

    def _close(self) -> None:
        for peer in list(self._peers.values()):
            self._disconnect(peer)


# --- the registry (registry.py) -------------------------------------------------------------


def engine_class(name: str) -> type[TransferEngine]:
    """The engine class for ``name``; imports its native package now (``EngineUnavailable``)."""
    try:
        entry = ENGINES[name]
    except KeyError:
        raise EngineError(f"unknown transfer engine {name!r}; known engines: {', '.join(ENGINES)}") from None
    cls = getattr(importlib.import_module(entry.module), entry.class_name)
    cls.check_available()
    return cls


def create_engine(name: str, **options: Any) -> TransferEngine:
    """Construct (not start) engine ``name`` with ``options``; see each engine's constructor."""
    return engine_class(name)(**options)
