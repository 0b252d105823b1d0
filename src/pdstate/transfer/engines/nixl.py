"""NIXL adapter, UCX backend, DRAM or VRAM (``pip install 'pdstate[nixl]'``).

Each engine owns one ``nixl_agent`` named ``agent_name`` (default ``pdstate-<pid>-<engine_id>``,
unique per start). Regions are registered as ``Nx3`` uint64 rows ``(addr, len, device)`` of type
"DRAM" (host memory, device 0) or "VRAM" (a CUDA device's memory, ``pools.placement``: all of one
engine's regions on one device; UCX then moves them with ``cuda_ipc``/``cuda_copy``); a decode on
a device says so in its endpoint (``mem_type``, ``device``: absent for DRAM). The decode endpoint carries the agent metadata (``get_agent_metadata()``, taken when
``endpoint()`` is called, so register first); ``connect`` loads it with ``add_remote_agent``.
``submit`` builds both descriptor lists from the plan's columns and posts one WRITE with
``initialize_xfer`` + ``transfer``; ``poll`` maps ``check_xfer_state``: "DONE" -> done,
"PROC" -> in flight, "ERR" -> ``NativeEngineError``. On one host UCX picks ``cma``
(``process_vm_writev``): one kernel copy, about 4.5 us per descriptor, made inside ``transfer``
on the caller's thread, which then returns "DONE" (399 of 400 submits of 148 descriptors, 55 of
56 bench requests of 18-521 MB): the watcher below serves only the rest.

Per request (measured with ``tests/engines/measure_nixl_submit.py``, 148 descriptors, the
bench's count at every length, 2-core host at load 8-13): ``submit`` + ``poll`` to done takes
55-80 us more (medians) than NIXL's own ``initialize_xfer`` + ``transfer`` +
``release_xfer_handle`` with both lists built beforehand (the bench's ``raw_nixl`` row), about
240 us for 64-byte descriptors. Of that, building both lists here is 6-13 us and the plan's
checks (``regions.check_plan``, every engine's) 20-80 us. A bench request over NIXL at 8k tokens
(42 MB, ``verify = off``) spent 7-15 ms in ``transfer`` and 2.1-2.6 ms (medians) outside it,
outside this engine: the request reaching the prefill, its worker handing the chunk to the
agent, the agent's planning and the plan's checks, ``TransferDone`` reaching the decode. Per byte
the engine adds nothing measurable: in the bench's prefill worker, NIXL's own write of the same
plan from the same agent just before and just after each engine submission of a 128k-token
request (521 MB, 148 descriptors, ``DONE`` from ``transfer`` every time) took as long as the
submission (medians 190 / 188 / 186 ms at load 11). The same native write from another agent
(the bench's ``raw_nixl`` row) runs up to 2-3x faster or slower, often steadily over a run: a
matter of the writer, not of what it hands NIXL (docs/performance.md, "NIXL at 8k"; the bench's
``raw_nixl_prefill`` row writes from the prefill worker's own pools).

Completion callbacks: ``on_done(handle, fn)`` calls ``fn()`` once the handle finished or failed:
at once when it already has, else from one watcher thread per engine (started on first use) that
polls the handles watched (``check_xfer_state`` under the engine's lock) while any is in flight,
pausing 50 us after a new one and twice as long after each poll that saw none end, up to 200 us
(``WATCH_PAUSE_S``), and sleeps otherwise: a WRITE's end is seen within a fifth of a millisecond
(the prefill agent, polling on its own each millisecond, saw it up to a millisecond late, a tenth
of a 2k-token request's time on NIXL here).

Completion notifications: ``submit(peer, plan, notify=b"...")`` passes the message as the
NIXL notification of the transfer; the decode side reads it with ``notifications()``
(``get_new_notifs``), as ``(prefill agent name, message)`` pairs.

Endpoint::

    {"engine": "nixl", "engine_id": str, "agent_name": str, "metadata": bytes,
     "regions": [{"name": str, "base_ptr": int, "nbytes": int}]}

Traps (measured on this box):

* EXIT SEGFAULT. A process that created a UCX agent dies with SIGSEGV (rc 139) at interpreter
  exit, even after ``close()``: the backtrace ends in ``rtnl_tc_unregister`` of the
  ``libnl-route`` bundled with UCX's InfiniBand module, run by ``_dl_fini`` while the system
  ``libnl-route`` (pulled in by the system libibverbs) is loaded too. Work-arounds: pass
  ``ucx_env=UCX_ENV_WITHOUT_IB`` (``UCX_MODULES=^ib``: UCX does not load its IB modules; fine on
  hosts without RDMA NICs, which use cma/tcp anyway), or end the process with ``os._exit``
  after ``close()``. UCX reads its settings only from the environment, and only when the first
  agent of the process is created, hence ``ucx_env`` is applied to ``os.environ`` in ``start``
  (the caller, an edge, decides it).
* ``UCX_TLS=posix,sysv,self`` fails to create the backend (NIXL asks for peer-failure handling,
  which the shared-memory transports lack).
* The agent is not thread-safe in its default sync mode; the engine's lock (``base.py``)
  serialises every call into it.
* A peer that went away fails the next transfer at once with ``NIXL_ERR_REMOTE_DISCONNECT``.
* LISTENERS. UCX's TCP transport listens on one socket per network device it uses (measured:
  ``127.0.0.1`` and the host's LAN address), unauthenticated. ``UCX_NET_DEVICES=lo`` (the
  ``ucx_env``; ``transfer.nixl.net_devices``) keeps it on loopback: then one host only (cma).
* IDLE CPU. Each agent's progress thread (NIXL's default, ``enable_prog_thread=True``) waits
  in ``poll`` on UCX's event fd for at most its delay, which NIXL's Python API sets to 0: the
  thread never sleeps, a core busy per agent even with nothing to move (two idle agents: 5.9 s
  of CPU in 3 s; at load 15, 0 voluntary context switches in 3 s, always
  runnable; nixl-cu12 1.5.1, UCX over cma/tcp; ``UCX_TLS`` did not change it). Without the
  progress thread a transfer between two agents stalled (the target must progress too), so it
  stays on, with a delay of ``progress_delay_us`` (``PROGRESS_DELAY_US``, 1 ms; ``_new_agent``):
  the same two threads then slept about 850 times a second and used 0.03 s of CPU each in 3 s;
  a peer's message still wakes the thread at once (event fd). ``progress_delay_us=0`` gives
  NIXL's own busy thread back. ``pdstate bench`` runs each engine in its own phase. The thread
  waits in whole milliseconds: 1000, 200, 100 and 50 all gave about 930 sleeps a second per
  thread and 0.05-0.07 s of CPU for two idle agents in 3 s, so no delay under 1 ms exists
  between this and the busy thread; the busy thread (0) made every NIXL bench row 2.6-6x
  slower on two cores (docs/performance.md, "NIXL at 2k").
* SPINNING WRITES. A WRITE's fragments are moved by whichever thread progresses the UCX worker
  first: the caller's, inside ``transfer``, and the agent's progress thread, which wakes during
  it. The two take the worker's lock in turns, and UCX's lock is a spinlock unless
  ``UCX_USE_MT_MUTEX=y``: the thread waiting spins as long as the other copies. On two busy
  cores that spinning takes half the CPU the write gets, and the same native write ran 2x
  slower in one process than in another, steadily, a lottery of which process's threads met
  (42 MB in 148 descriptors into one decode process, six fresh writer processes interleaved,
  21 rounds, load 39: spinlock 9.9 / 13.0 / 12.8 ms, mutex 6.6 / 6.4 / 6.3, one
  ``process_vm_writev`` of the same iovecs from the same processes 5.9-6.1; during a spinlock
  write the caller's thread and another thread of the process used 6.0-6.5 ms of CPU each,
  during a mutex write about 3.1 each: the copy, shared). ``UCX_ENV_DEFAULTS`` hence sets
  ``UCX_USE_MT_MUTEX=y`` unless the process's environment or ``ucx_env`` says otherwise.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from pdstate.errors import EngineError, InvalidEndpoint, NativeEngineError
from pdstate.pools.memory import Region
from pdstate.pools.placement import memory_devices
from pdstate.transfer.engines.base import Peer, TransferEngine, TransferHandle, TransferStatus, import_native
from pdstate.transfer.engines.listeners import Transport
from pdstate.transfer.plan import TransferPlan

NATIVE_MODULE = "nixl_cu12._api"
UCX_ENV_WITHOUT_IB: Mapping[str, str] = {"UCX_MODULES": "^ib"}
# set before an agent is created unless the environment or ``ucx_env`` already names them: UCX's
# worker lock a mutex, not a spinlock (see the spinning-writes trap)
UCX_ENV_DEFAULTS: Mapping[str, str] = {"UCX_USE_MT_MUTEX": "y"}
MEM_TYPE = "DRAM"
# the watcher's pause between polls while a watched WRITE is in flight: from the first, doubling
# up to the last while nothing ends (a long WRITE costs at most about 5,000 polls a second)
WATCH_PAUSE_S = (50e-6, 200e-6)
# the progress thread's longest wait between looks at UCX while nothing wakes it (its event fd
# does on a peer's message); NIXL's Python API would make it 0: a core spinning per agent
PROGRESS_DELAY_US = 1000
_CONFIG_SWAP = threading.Lock()  # one agent creation at a time swaps NIXL's config class


@contextmanager
def _native_call(what: str) -> Iterator[None]:
    """The one place NIXL's exceptions (``nixl*Error``, RuntimeError, ...) become engine errors."""
    try:
        yield
    except EngineError:
        raise
    except Exception as exc:
        raise NativeEngineError(f"nixl {what} failed: {type(exc).__name__}: {exc}", code=str(exc)) from exc


def _rows(addrs: np.ndarray, lengths: np.ndarray, device: int = 0) -> np.ndarray:
    """NIXL descriptor rows ``(addr, len, device)``, Nx3 uint64."""
    rows = np.zeros((addrs.shape[0], 3), dtype=np.uint64)
    rows[:, 0] = addrs
    rows[:, 1] = lengths
    rows[:, 2] = device
    return rows


def _new_agent(api: Any, name: str, config: Any, delay_us: int) -> Any:
    """``api.nixl_agent(name, config)`` whose progress thread waits up to ``delay_us`` between
    looks (``0``: NIXL's own setting). NIXL's Python API sets the native config's ``pthrDelay``
    to 0 itself, which makes the thread poll UCX without ever sleeping (see the idle-CPU trap);
    the native config class is swapped, for this one call, for a subclass that keeps at least
    ``delay_us``. Where the bindings lack the field, NIXL's own setting stays."""
    bind = getattr(api, "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    field = getattr(base, "__dict__", {}).get("pthrDelay")
    if delay_us <= 0 or not isinstance(field, property):
        return api.nixl_agent(name, config)

    class _Config(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:
            return int(field.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            field.__set__(self, max(int(value), delay_us))

    with _CONFIG_SWAP:
        bind.nixlAgentConfig = _Config
        try:
            return api.nixl_agent(name, config)
        finally:
            bind.nixlAgentConfig = base


def _placement(regions: list[Region]) -> tuple[str, int]:
    """``("DRAM", 0)`` for host regions, ``("VRAM", N)`` for regions on CUDA device ``N``."""
    devices = set(memory_devices([int(r.base_ptr) for r in regions]))
    if len(devices) > 1:
        raise EngineError(f"nixl: registered regions lie in more than one place ({sorted(map(str, devices))})")
    (device,) = devices or {None}
    return (MEM_TYPE, 0) if device is None else ("VRAM", int(device.split(":")[1]))


class NixlEngine(TransferEngine):
    """``NixlEngine(agent_name=None, backends=("UCX",), ucx_env=None, num_threads=0, progress_delay_us=1000)``.

    ``ucx_env``: variables set in ``os.environ`` just before the agent is created, e.g.
    ``UCX_ENV_WITHOUT_IB`` (see the exit-segfault trap); ``UCX_ENV_DEFAULTS`` fill in what
    neither it nor the environment sets (see the spinning-writes trap). ``num_threads``: UCX backend threads
    (0: NIXL's default). ``progress_delay_us``: the progress thread's longest sleep (see the
    idle-CPU trap; 0: NIXL's busy thread).
    """

    name = "nixl"
    endpoint_keys = ("agent_name", "metadata")
    supports_notify = True

    def __init__(
        self,
        agent_name: str | None = None,
        backends: Sequence[str] = ("UCX",),
        ucx_env: Mapping[str, str] | None = None,
        num_threads: int = 0,
        progress_delay_us: int = PROGRESS_DELAY_US,
    ) -> None:
        super().__init__()
        self.progress_delay_us = progress_delay_us
        self.agent_name = agent_name
        self.backends = tuple(backends)
        self.ucx_env = dict(ucx_env or {})
        self.num_threads = num_threads
        self.native: Any = None  # NIXL's own nixl_agent, once started (the bench's raw rows)
        self._reg_dlists: list[Any] = []
        self._inflight: dict[TransferHandle, Any] = {}  # handle -> native xfer handle (until settled)
        self._mem: tuple[str, int] = (MEM_TYPE, 0)  # where this engine's regions live
        self._peer_mem: dict[str, tuple[str, int]] = {}  # remote agent name -> where its regions live
        self._watched: list[tuple[TransferHandle, Callable[[], None]]] = []  # ``on_done``'s, under _watch_cv
        self._watch_cv = threading.Condition(threading.Lock())
        self._watcher: threading.Thread | None = None
        self._watch_stop = False
        self._added = 0  # handles ever watched (a new one resets the watcher's pause)

    @classmethod
    def check_available(cls) -> None:
        import_native(NATIVE_MODULE, cls.name, "nixl")

    def transport(self) -> Transport:
        """UCX picks a transport per peer (``cma`` on one host, ``tcp``, ``rc`` ...): reported as
        ``ucx`` with the ``UCX_TLS`` it was started with."""
        tls = f"ucx ({os.environ.get('UCX_TLS', 'UCX_TLS unset: any')})"
        return Transport(self.name, tls, tls, super().transport().listening)

    def _start(self) -> None:
        api = import_native(NATIVE_MODULE, self.name, "nixl")
        if self.agent_name is None:
            self.agent_name = f"pdstate-{os.getpid()}-{self._engine_id}"
        os.environ.update(self.ucx_env)
        for key, value in UCX_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        with _native_call(f"agent creation ({self.agent_name}, backends {list(self.backends)})"):
            config = api.nixl_agent_config(backends=list(self.backends), num_threads=self.num_threads)
            agent = _new_agent(api, self.agent_name, config, self.progress_delay_us)
        missing = [b for b in self.backends if b not in agent.backends]
        if missing:
            raise NativeEngineError(f"nixl agent {self.agent_name}: backend(s) {missing} could not be created")
        self.native = agent

    def _register(self, regions: list[Region]) -> None:
        addrs = np.array([r.base_ptr for r in regions], dtype=np.uint64)
        lengths = np.array([r.nbytes for r in regions], dtype=np.uint64)
        self._mem = mem, device = _placement(regions)
        with _native_call(f"register_memory ({', '.join(r.name for r in regions)})"):
            self._reg_dlists.append(self.native.register_memory(_rows(addrs, lengths, device), mem))

    def _endpoint_fields(self) -> dict:
        with _native_call("get_agent_metadata"):
            metadata = bytes(self.native.get_agent_metadata())
        where = {} if self._mem[0] == MEM_TYPE else {"mem_type": self._mem[0], "device": self._mem[1]}
        return {"agent_name": self.agent_name, "metadata": metadata, **where}

    def _connect(self, peer: Peer) -> None:
        expected = str(peer.endpoint["agent_name"])
        with _native_call(f"add_remote_agent ({expected})"):
            name = self.native.add_remote_agent(bytes(peer.endpoint["metadata"]))
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != expected:
            raise InvalidEndpoint(f"nixl endpoint names agent {expected!r} but its metadata is {name!r}")
        peer.native = name
        self._peer_mem[name] = (str(peer.endpoint.get("mem_type", MEM_TYPE)), int(peer.endpoint.get("device", 0)))

    def _disconnect(self, peer: Peer) -> None:
        if peer.native is not None:
            with _native_call(f"remove_remote_agent ({peer.native})"):
                self.native.remove_remote_agent(peer.native)
            self._peer_mem.pop(peer.native, None)
            peer.native = None

    def _submit(self, peer: Peer, plan: TransferPlan, handle: TransferHandle, notify: bytes) -> None:
        what = f"WRITE of {len(plan)} descriptors to {peer.native}"
        with _native_call(what):
            (lmem, ldev), (rmem, rdev) = self._mem, self._peer_mem.get(peer.native, (MEM_TYPE, 0))
            local = self.native.get_xfer_descs(_rows(plan.src, plan.length, ldev), lmem)
            remote = self.native.get_xfer_descs(_rows(plan.dst, plan.length, rdev), rmem)
            xfer = self.native.initialize_xfer("WRITE", local, remote, peer.native, notify)
        try:
            with _native_call(what):
                state = self.native.transfer(xfer)
        except EngineError:
            self._release(xfer)
            raise
        handle.native = xfer
        self._inflight[handle] = xfer
        self._settle(handle, state)

    def on_done(self, handle: TransferHandle, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once ``handle`` has finished or failed: at once when it already has, else
        from the engine's watcher thread as soon as a poll sees it end (``poll`` then tells
        which). ``fn`` must be quick and must not call back into the engine (post to the
        caller's own thread). A handle still in flight at ``close`` gets its call then."""
        if handle.status is not TransferStatus.PENDING:
            fn()
            return
        with self._watch_cv:
            if self._watch_stop:
                stopped = True
            else:
                stopped = False
                self._watched.append((handle, fn))
                self._added += 1
                if self._watcher is None:
                    self._watcher = threading.Thread(target=self._watch, name="pdstate-nixl-watch", daemon=True)
                    self._watcher.start()
                self._watch_cv.notify()
        if stopped:
            fn()

    def _watch(self) -> None:
        """The watcher thread: poll the watched handles while any is pending, sleep otherwise."""
        first, longest = WATCH_PAUSE_S
        pause, seen = first, 0
        while True:
            with self._watch_cv:
                while not self._watched and not self._watch_stop:
                    self._watch_cv.wait()
                if self._watch_stop:
                    return
                watched = list(self._watched)
                if self._added != seen:  # a new WRITE to watch: look closely again
                    pause, seen = first, self._added
            ended = []
            for handle, fn in watched:
                # never blocks on the engine's lock: ``close`` holds it while it stops this thread
                if handle.status is TransferStatus.PENDING and self._lock.acquire(timeout=first):
                    try:
                        if handle.status is TransferStatus.PENDING and self.native is not None:
                            self._poll(handle)
                    except EngineError:
                        pass  # the handle carries its failure: ``poll`` raises it
                    finally:
                        self._lock.release()
                if handle.status is not TransferStatus.PENDING:
                    ended.append((handle, fn))
            if ended:
                with self._watch_cv:
                    self._watched = [w for w in self._watched if w not in ended]
                for _, fn in ended:
                    self._call(fn)
            else:
                time.sleep(pause)
                pause = min(longest, pause * 2)

    @staticmethod
    def _call(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # a caller's callback must not end the watcher
            pass

    def _stop_watcher(self) -> None:
        with self._watch_cv:
            self._watch_stop = True
            left, self._watched = self._watched, []
            self._watch_cv.notify()
        watcher = self._watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(5)
        for _, fn in left:  # ended by the close: their callers look (poll raises ``EngineStateError``)
            self._call(fn)

    def _poll(self, handle: TransferHandle) -> None:
        with _native_call(f"check_xfer_state ({handle.peer_id})"):
            state = self.native.check_xfer_state(handle.native)
        self._settle(handle, state)

    def _settle(self, handle: TransferHandle, state: str) -> None:
        if state == "PROC":
            return
        xfer = self._inflight.pop(handle)
        self._release(xfer)
        if state == "DONE":
            handle.finish()
        else:
            handle.fail(
                NativeEngineError(
                    f"nixl WRITE of {handle.num_descriptors} descriptors ({handle.total_bytes} bytes) "
                    f"to {handle.peer_id} ended in state {state!r}",
                    code=state,
                )
            )

    def _release(self, xfer: Any) -> None:
        try:
            self.native.release_xfer_handle(xfer)
        except Exception:  # releasing is best effort; the transfer's own state was reported
            pass

    def _notify(self, peer: Peer, message: bytes) -> None:
        with _native_call(f"send_notif to {peer.native}"):
            self.native.send_notif(peer.native, message)

    def _notifications(self) -> list[tuple[str, bytes]]:
        with _native_call("get_new_notifs"):
            notifs = self.native.get_new_notifs()
        return [(str(sender), bytes(m)) for sender, msgs in notifs.items() for m in msgs]

    def _close(self) -> None:
        self._stop_watcher()
        agent = self.native
        if agent is None:
            return
        for xfer in self._inflight.values():
            self._release(xfer)  # aborts a transfer still in flight
        self._inflight.clear()
        for peer in list(self._peers.values()):
            try:
                self._disconnect(peer)
            except EngineError:
                pass  # closing anyway
        for dlist in self._reg_dlists:
            try:
                agent.deregister_memory(dlist)
            except Exception:
                pass
        self._reg_dlists.clear()
        self.native = None
