"""Mooncake Transfer Engine adapter (``pip install 'pdstate[mooncake]'``).

Each engine creates one ``mooncake.engine.TransferEngine`` initialised with ``P2PHANDSHAKE``
metadata (no etcd): ``initialize(host, "P2PHANDSHAKE", protocol, device_name)`` with protocol
"tcp" (default; works on one host) or "rdma" (``device_name`` picks the NICs, comma-separated).
The session id a peer dials is ``f"{host}:{get_rpc_port()}"``, so ``host`` must be an address
the peer can reach.

Endpoint::

    {"engine": "mooncake", "engine_id": str, "session_id": "host:port",
     "regions": [{"name": str, "base_ptr": int, "nbytes": int}]}

Submission. A plan is cut into windows of at most ``max_batch_descriptors`` (2048) and written
on ONE worker thread, window after window: each descriptor of a window is submitted with
``transfer_submit_write`` (its own native batch of one), then the worker checks them in order with
``transfer_check_status`` (which does not block), sleeping between checks (20 us, doubling up to
``poll_interval_s``, 0.2 ms). A window ends when every descriptor in it has ended; a failure is
raised only then, so nothing of a failed plan is still in flight when the caller hears of it.
Why not ``batch_transfer_sync_write`` (``completion="sync"``, the fallback for a native build
without those two calls): it spins on the batch's status until the batch ends, a whole core for
the length of the copy, and on a host whose cores the TCP copy itself needs (a sender and a
receiver thread) that spin slows the copy it waits for: on 2 shared cores a request's bytes moved
1.5-2.8x faster submitted and polled than written with the spinning call (same plan, same peer,
interleaved; see docs/performance.md). ``batch_transfer_async_write`` is no better: ``get_batch_transfer_status``
spins too, and ``transfer_check_status`` looks at a batch's first entry only. ``poll``/``wait``
look at the worker's future; ``on_done(handle, fn)`` calls ``fn`` from the worker as soon as the
handle's write ended, landed or failed (the agents wake on it instead of waiting for their I/O
loop's next tick).

Traps (measured, see ``shared/reference/engines_measured.md``):

* The TCP initiator queues about 2048 transfers per peer; a bigger batch is rejected (-1) and
  the rejection POISONS the engine: every later transfer to that peer returns -1 until a new
  engine is created. Hence the 2048 cap on the descriptors in flight (a window) and the single
  worker. The native limit can be raised
  with ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` (e.g. 32768, set before the first engine is
  created; 65536 is silently ignored); a bigger batch gains nothing, cost is per descriptor.
* ``MC_TRANSFER_TIMEOUT`` (seconds, min 5, default 30) bounds a native sync write, and the worker
  bounds a polled window the same way (that many seconds plus one per GB of the window, as the
  native call does); a write to a peer that stops answering mid-transfer blocks the worker that
  long. A window that timed out so returns while some of its descriptors may still be in flight:
  the worker keeps checking those (``unended_batches``) every 10 ms between later calls, and
  the check that sees one end frees its batch id (the binding frees a batch only there, on
  completed or failed; it has no call to free one, and frees none it reports timed out, -2).
  ``wait`` still returns
  at its own deadline; ``close`` waits up to ``close_timeout_s`` for the worker and otherwise
  leaves the native engine alive (never freed under a running call).
* Every failure is one native code (-1 mostly; ``send_probe`` returns e.g. -102 for a refused
  connection). Messages name the operation, the peer, the batch and the code.
* Mooncake logs (glog) to stderr; that is expected.
* QUIET TCP. ``initialize`` discovers the host's RDMA devices whatever the protocol (on a host with
  none it warns "No RDMA devices found, check your device installation"), and
  ``get_local_topology`` builds and initialises a second native engine to read the topology (a
  second warning, a second listener). With protocol "tcp" the engine reads neither: it sets
  Mooncake's ``MC_CUSTOM_TOPO_JSON`` to a file holding an empty topology for the length of its own
  ``initialize`` (unless the operator set that variable), so Mooncake parses it instead of probing
  devices and installs its TCP transport (as it does on a host with no RDMA device: the protocol
  asked for is the one used), and it skips ``get_local_topology`` (``hcas`` 0; the second engine
  took about a second to go away: ``start`` measured 1138 ms median before, 77 ms after). Every other line
  Mooncake logs, errors included, still reaches stderr. ``rdma`` is unchanged.
* SILENT FALLBACK. ``protocol="rdma"`` on a host whose topology has no RDMA device (0 HCAs)
  starts anyway, on the TCP transport ("Found 0 HCAs", then "TcpTransport: listen on port").
  ``transport()`` says so (``in_use`` "tcp", ``problem``): a worker is then not ready.
* OPEN LISTENERS. Its P2P handshake RPC socket and its TCP transport's socket bind every
  interface (``0.0.0.0`` / ``[::]``) whatever ``host`` says, and authenticate nobody;
  ``MC_TCP_BIND_ADDRESS`` only names the advertised address outside P2P mode (source and
  measurement: docs/security.md).
"""

from __future__ import annotations

import json
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Any

from pdstate.errors import EngineError, NativeEngineError
from pdstate.pools.memory import Region
from pdstate.transfer.engines.base import Peer, TransferEngine, TransferHandle, import_native
from pdstate.transfer.engines.listeners import Transport
from pdstate.transfer.plan import TransferPlan

NATIVE_MODULE = "mooncake.engine"
MAX_BATCH_DESCRIPTORS = 2048
COMPLETIONS = ("poll", "sync")  # submit and poll each descriptor (sleeping), or the native's spinning sync write
POLL_FIRST_S = 20e-6  # the first pause between status checks of a window; it doubles up to ``poll_interval_s``
POLL_INTERVAL_S = 200e-6  # ``poll_interval_s``'s default: the longest pause between status checks
UNENDED_PAUSE_S = 0.01  # between the worker's looks at the descriptors a timed-out window left in flight
BAD_BATCH = (1 << 64) - 1  # ``transfer_submit_write``'s -1, as the unsigned batch id it returns

# Mooncake's variable naming a topology file read at ``initialize`` instead of probing RDMA devices
TOPOLOGY_ENV = "MC_CUSTOM_TOPO_JSON"
EMPTY_TOPOLOGY = "{}"  # no CPU, no HCA: Mooncake then installs its TCP transport
_ENV_LOCK = threading.Lock()  # one engine at a time sets and restores the variable

# native engines whose worker did not stop in time: kept referenced so they are never freed
# while a native call may still be running on them
_ABANDONED: list[Any] = []


class _Worker:
    """One thread running native calls in submission order; each call gets a ``Future``.

    ``idle``: called on the thread before it takes the next call; it returns how long the thread
    may wait for one before calling ``idle`` again (``None``: until a call comes)."""

    def __init__(self, thread_name: str, idle: Callable[[], float | None] | None = None) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closing = False
        self._idle = idle
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            wait = self._idle() if self._idle is not None and not self._closing else None
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                continue
            if item is None:
                return
            future, fn, args = item
            if self._closing:
                future.set_exception(EngineError("mooncake engine closed before the transfer ran"))
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever polls the future
                future.set_exception(exc)

    def stop(self, timeout_s: float) -> bool:
        """Fail queued calls, let the running one end; True if the thread ended in time."""
        self._closing = True
        self._queue.put(None)
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()


class MooncakeEngine(TransferEngine):
    """``MooncakeEngine(host="127.0.0.1", protocol="tcp", device_name="", ...)``.

    ``max_batch_descriptors``: descriptors in flight at once (keep <= 2048 unless the native queue
    was raised). ``completion``: ``"poll"`` (submit each descriptor, check them in order, sleeping
    between checks up to ``poll_interval_s``) or ``"sync"`` (the native's
    ``batch_transfer_sync_write``, which spins a core until the batch ends); ``"poll"`` falls back
    to ``"sync"`` on a native build without ``transfer_submit_write``/``transfer_check_status``.
    ``probe_on_connect``: ``connect`` sends a JSON-RPC probe so a bogus or dead session fails
    there, within ``connect_timeout_s``. ``close_timeout_s``: how long ``close`` waits for a
    native call in flight.
    """

    name = "mooncake"
    endpoint_keys = ("session_id",)

    def __init__(
        self,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        max_batch_descriptors: int = MAX_BATCH_DESCRIPTORS,
        probe_on_connect: bool = True,
        connect_timeout_s: float = 10.0,
        close_timeout_s: float = 10.0,
        completion: str = "poll",
        poll_interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        super().__init__()
        if max_batch_descriptors < 1:
            raise ValueError(f"max_batch_descriptors must be >= 1, got {max_batch_descriptors}")
        if completion not in COMPLETIONS:
            raise ValueError(f"completion must be one of {', '.join(COMPLETIONS)}, got {completion!r}")
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        self.host = host
        self.protocol = protocol
        self.device_name = device_name
        self.max_batch_descriptors = max_batch_descriptors
        self.probe_on_connect = probe_on_connect
        self.connect_timeout_s = connect_timeout_s
        self.close_timeout_s = close_timeout_s
        self.completion = completion  # the one in use once started (``"sync"`` where the native cannot poll)
        self.poll_interval_s = poll_interval_s
        self.native: Any = None  # Mooncake's own TransferEngine, once started (the bench's raw rows)
        self._worker: _Worker | None = None
        self._registered_ptrs: list[int] = []
        # batch ids of timed-out windows not seen ending yet (the worker's alone): checked until they end
        self._unended: list[int] = []
        self.session_id = ""
        self.hcas = 0  # RDMA devices in the native topology, read at start

    @classmethod
    def check_available(cls) -> None:
        import_native(NATIVE_MODULE, cls.name, "mooncake")

    @staticmethod
    def _check(rc: int, what: str) -> None:
        """The one place native return codes become errors."""
        if rc != 0:
            raise NativeEngineError(f"mooncake {what} failed: code {rc}", code=rc)

    def _start(self) -> None:
        native = import_native(NATIVE_MODULE, self.name, "mooncake").TransferEngine()
        with topology_for(self.protocol):
            rc = native.initialize(self.host, "P2PHANDSHAKE", self.protocol, self.device_name)
        self._check(rc, f"initialize(host={self.host!r}, protocol={self.protocol!r}, device={self.device_name!r})")
        self.native = native
        if not all(hasattr(native, m) for m in ("transfer_submit_write", "transfer_check_status")):
            self.completion = "sync"
        self.session_id = f"{self.host}:{native.get_rpc_port()}"
        # the topology matters to RDMA only; reading it initialises a second native engine
        self.hcas = count_hcas(native.get_local_topology()) if self.protocol != "tcp" else 0
        self._worker = _Worker(f"pdstate-mooncake-{self.session_id}", idle=self._check_unended)
        self._worker.start()

    def transport(self) -> Transport:
        """``rdma`` only when asked for and the topology has an RDMA device; else ``tcp`` (with
        the fallback named as ``problem`` when ``rdma`` was asked for)."""
        base = super().transport()
        in_use = "rdma" if self.protocol == "rdma" and self.hcas else "tcp"
        problem = None
        if self.protocol == "rdma" and in_use == "tcp":
            problem = (
                f"mooncake was configured with protocol 'rdma' (device {self.device_name!r}) but found no RDMA "
                "device (0 HCAs in its topology) and fell back to TCP; fix the RDMA set-up, or set "
                'transfer.mooncake.protocol = "tcp"'
            )
        return Transport(self.name, self.protocol, in_use, base.listening, problem)

    def _register(self, regions: list[Region]) -> None:
        for r in regions:
            self._check(
                self.native.register_memory(r.base_ptr, r.nbytes),
                f"register_memory(region {r.name!r} at 0x{r.base_ptr:x}, {r.nbytes} bytes)",
            )
            self._registered_ptrs.append(r.base_ptr)

    def _endpoint_fields(self) -> dict:
        return {"session_id": self.session_id}

    def _connect(self, peer: Peer) -> None:
        session_id = str(peer.endpoint["session_id"])
        peer.native = session_id
        if not self.probe_on_connect:
            return
        assert self._worker is not None
        future = self._worker.call(self.native.send_probe, session_id)
        try:
            rc = future.result(timeout=self.connect_timeout_s)
        except FutureTimeout as exc:
            raise EngineError(
                f"mooncake connect to {session_id}: send_probe timed out after {self.connect_timeout_s:g} s"
            ) from exc
        self._check(rc, f"send_probe to {session_id} (connect)")

    def _submit(self, peer: Peer, plan: TransferPlan, handle: TransferHandle, notify: bytes) -> None:
        assert self._worker is not None
        handle.native = self._worker.call(self._write, peer.native, plan)

    def _write(self, session_id: str, plan: TransferPlan) -> None:
        """Runs on the worker: one window (or sync batch) per chunk, stopping at the first failure."""
        num_chunks = -(-len(plan) // self.max_batch_descriptors)
        write = self._write_sync if self.completion == "sync" else self._write_polled
        for k, chunk in enumerate(plan.chunks(self.max_batch_descriptors)):
            failed = write(session_id, chunk)
            if failed is not None:
                op, rc = failed
                first = k * self.max_batch_descriptors
                raise NativeEngineError(
                    f"mooncake {op} to {session_id} failed on chunk "
                    f"{k + 1} of {num_chunks} (descriptors {first}..{first + len(chunk) - 1}, "
                    f"{chunk.total_bytes} bytes): code {rc}",
                    code=rc,
                )

    def _write_sync(self, session_id: str, chunk: TransferPlan) -> tuple[str, int] | None:
        rc = self.native.batch_transfer_sync_write(
            session_id, chunk.src.tolist(), chunk.dst.tolist(), chunk.length.tolist()
        )
        return ("batch_transfer_sync_write", rc) if rc < 0 else None

    def _write_polled(self, session_id: str, chunk: TransferPlan) -> tuple[str, int] | None:
        """Submit each descriptor of ``chunk``, then wait, sleeping, until every one submitted has
        ended; the first failure (the operation and its code), or None. A failed submission stops
        the submitting; what was submitted before it is still waited for."""
        native = self.native
        submit, check = native.transfer_submit_write, native.transfer_check_status
        ids: list[int] = []
        failed: tuple[str, int] | None = None
        for s_, d_, n_ in zip(chunk.src.tolist(), chunk.dst.tolist(), chunk.length.tolist()):
            batch = submit(session_id, s_, d_, n_)
            if batch <= 0 or batch == BAD_BATCH:
                failed = ("transfer_submit_write", -1)
                break
            ids.append(batch)
        deadline = time.monotonic() + transfer_timeout_s() + chunk.total_bytes * 1e-9
        pause, i = POLL_FIRST_S, 0
        while i < len(ids):
            rc = check(ids[i])
            if rc == 0:  # still moving
                if time.monotonic() > deadline:  # the native's own timeout has passed
                    self._unended.extend(ids[i:])  # checked by the worker until each one ended
                    return ("transfer_check_status", -2)
                time.sleep(pause)
                pause = min(pause * 2, self.poll_interval_s)
                continue
            if rc < 0 and failed is None:  # -1 failed, -2 timed out: the rest is still waited for
                failed = ("transfer_check_status", rc)
            i += 1
        return failed

    @property
    def unended_batches(self) -> int:
        """Descriptors of timed-out windows not yet seen ending (each still holds its native batch
        id): the worker checks them between calls until each one ends."""
        return len(self._unended)

    def _check_unended(self) -> float | None:
        """The worker, before its next call: check each descriptor a timed-out window left in
        flight; one that ended (1, or -1: failed) was freed by that very check (Mooncake's binding
        frees a batch id when ``transfer_check_status`` sees it completed or failed, and offers no
        other way to free one). One the native reports timed out (-2) is dropped unfreed: the
        binding frees no such batch. Returns the pause before the next look (``None``: none left)."""
        native = self.native
        if native is None:
            return None
        check = native.transfer_check_status
        self._unended = [b for b in self._unended if check(b) == 0]
        return UNENDED_PAUSE_S if self._unended else None

    def on_done(self, handle: TransferHandle, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once ``handle`` has finished or failed: at once when it already has, else
        on the worker thread right after the native call returned (so a caller's event loop can
        wake then instead of polling). ``fn`` must be quick and must not call back into the
        engine from the worker (post to the caller's own thread)."""
        future = handle.native
        if future is None:
            fn()
        else:
            future.add_done_callback(lambda _f: fn())

    def _poll(self, handle: TransferHandle) -> None:
        if handle.native.done():
            self._settle(handle)

    def _wait(self, handle: TransferHandle, deadline: float) -> None:
        try:
            handle.native.exception(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            return
        self._settle(handle)

    @staticmethod
    def _settle(handle: TransferHandle) -> None:
        exc = handle.native.exception()
        if exc is None:
            handle.finish()
        elif isinstance(exc, EngineError):
            handle.fail(exc)
        else:
            error = NativeEngineError(f"mooncake transfer to {handle.peer_id} raised {exc!r}")
            error.__cause__ = exc
            handle.fail(error)

    def _close(self) -> None:
        stopped = self._worker.stop(self.close_timeout_s) if self._worker is not None else True
        native, self.native, self._worker = self.native, None, None
        if native is None:
            return
        if not stopped:
            _ABANDONED.append(native)  # a native call is still running on it: never free it
            return
        self._unended = [b for b in self._unended if native.transfer_check_status(b) == 0]  # a last look
        for ptr in self._registered_ptrs:
            native.unregister_memory(ptr)  # best effort: the engine is dropped right after
        self._registered_ptrs.clear()
        del native


@contextmanager
def topology_for(protocol: str) -> Iterator[None]:
    """Around a native ``initialize``: for protocol "tcp", Mooncake reads an empty topology from a
    file (``MC_CUSTOM_TOPO_JSON``) instead of probing RDMA devices, which warns on a host without
    any. Nothing changes for another protocol, or where the operator set the variable."""
    if protocol != "tcp":
        yield
        return
    with _ENV_LOCK:
        if TOPOLOGY_ENV in os.environ:  # the operator's own topology
            yield
            return
        with tempfile.TemporaryDirectory(prefix="pdstate-mooncake-") as folder:
            path = os.path.join(folder, "topology.json")
            with open(path, "w", encoding="utf-8") as f:
                f.write(EMPTY_TOPOLOGY)
            os.environ[TOPOLOGY_ENV] = path
            try:
                yield
            finally:
                os.environ.pop(TOPOLOGY_ENV, None)


def transfer_timeout_s() -> float:
    """Mooncake's own bound on a sync write, in seconds: ``MC_TRANSFER_TIMEOUT`` (at least 5; 30
    when unset)."""
    try:
        return float(max(5, int(os.environ.get("MC_TRANSFER_TIMEOUT", "30"))))
    except ValueError:  # the native reads it with atoi: 0, then at least 5
        return 5.0


def count_hcas(topology: str) -> int:
    """RDMA devices named in Mooncake's topology JSON (``{"cpu:0": [[preferred], [available]]}``)."""
    try:
        doc = json.loads(topology or "{}")
    except ValueError:
        return 0
    lists = [x for v in (doc.values() if isinstance(doc, dict) else ()) if isinstance(v, list) for x in v]
    return len({h for hcas in lists if isinstance(hcas, list) for h in hcas if isinstance(h, str)})
