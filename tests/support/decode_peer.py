"""The decode side of the engine contract tests: owns the destination memory, serves read-backs.

For shm/mooncake/nixl it runs in a separate process (``RemoteDecode``: a ``forkserver`` child
that preloads this module, so each child starts in milliseconds instead of re-importing torch);
its destination regions are ``SharedMemory`` segments for shm and private memory otherwise. The
loopback engine needs both sides in one process (``LocalDecode``). Both expose one interface:
``endpoint``, ``dst_regions``, ``read()``, ``reset()``, ``notifications()``, ``stop()`` (graceful:
engine closed, shm segments unlinked), ``kill()`` (SIGKILL for a child) and ``close()``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from typing import Any

import numpy as np
import torch

from pdstate.pools.memory import BufferSpec, PrivateMemory, Region, SharedMemory
from pdstate.transfer.engines import create_engine
from tests.support.images import SENTINEL

DST_SIZES = (12 << 20, 1 << 20)  # two destination regions, bytes
CHILD_START_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 20.0
CHILD_IDLE_TIMEOUT_S = 600.0  # a child whose parent vanished exits after this


class _DecodeState:
    """Destination memory + started engine; used in the child and by ``LocalDecode``."""

    def __init__(self, engine_name: str, options: dict[str, Any]) -> None:
        self.memory = SharedMemory() if engine_name == "shm" else PrivateMemory()
        self.tensors = [
            self.memory.allocate(f"dst{i}", [BufferSpec("bytes", (n,), torch.uint8)])[0]
            for i, n in enumerate(DST_SIZES)
        ]
        self.reset()
        self.engine = create_engine(engine_name, **options)
        self.engine.start()
        self.engine.register(self.memory.regions())
        self.endpoint = self.engine.endpoint()
        self.dst_regions = self.memory.regions()

    def reset(self) -> None:
        for t in self.tensors:
            t.fill_(SENTINEL)

    def read(self) -> list[bytes]:
        return [t.numpy().tobytes() for t in self.tensors]

    def notifications(self) -> list[tuple[str, bytes]]:
        return self.engine.notifications() if self.engine.supports_notify else []

    def stop(self) -> None:
        self.engine.close()
        self.memory.close()


def serve(conn: Any, engine_name: str, options: dict[str, Any]) -> None:
    """Child main: build the decode side, then answer commands until "stop" or EOF."""
    try:
        state = _DecodeState(engine_name, options)
        conn.send(("ok", (state.endpoint, [(r.name, r.base_ptr, r.nbytes) for r in state.dst_regions])))
        while conn.poll(CHILD_IDLE_TIMEOUT_S):
            cmd = conn.recv()
            try:
                result = {
                    "read": state.read,
                    "reset": state.reset,
                    "notifications": state.notifications,
                    "stop": state.stop,
                }[cmd]()
            except Exception as exc:  # reported to the test, which raises it
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
                continue
            conn.send(("ok", result))
            if cmd == "stop":
                break
    except (EOFError, OSError):
        pass
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        os._exit(0)  # skip interpreter teardown: NIXL's UCX may segfault there (see engines/nixl.py)


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


class RemoteDecode:
    """The decode side in a child process, driven over a ``Pipe`` with deadlines."""

    def __init__(self, engine_name: str, options: dict[str, Any]) -> None:
        ctx = _context()
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=serve, args=(child_conn, engine_name, options), daemon=True, name=f"decode-{engine_name}"
        )
        self.process.start()
        child_conn.close()
        self.endpoint, regions = self._recv(CHILD_START_TIMEOUT_S)
        self.dst_regions = [Region(*r) for r in regions]

    def _recv(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"decode child did not answer within {timeout_s:g} s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"decode child failed: {value}")
        return value

    def _call(self, cmd: str) -> Any:
        self._conn.send(cmd)
        return self._recv(CALL_TIMEOUT_S)

    def read(self) -> list[np.ndarray]:
        return [np.frombuffer(b, dtype=np.uint8) for b in self._call("read")]

    def reset(self) -> None:
        self._call("reset")

    def notifications(self) -> list[tuple[str, bytes]]:
        return self._call("notifications")

    def stop(self) -> None:
        self._call("stop")
        self.process.join(CALL_TIMEOUT_S)

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(CALL_TIMEOUT_S)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.stop()
            except (RuntimeError, TimeoutError, OSError, EOFError):
                self.kill()
        self._conn.close()


class LocalDecode:
    """The decode side in this process (loopback): same interface as ``RemoteDecode``."""

    def __init__(self, engine_name: str, options: dict[str, Any]) -> None:
        self._state = _DecodeState(engine_name, options)
        self.endpoint = self._state.endpoint
        self.dst_regions = self._state.dst_regions
        self._stopped = False

    def read(self) -> list[np.ndarray]:
        return [np.frombuffer(b, dtype=np.uint8) for b in self._state.read()]

    def reset(self) -> None:
        self._state.reset()

    def notifications(self) -> list[tuple[str, bytes]]:
        return self._state.notifications()

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._state.stop()

    kill = stop

    def close(self) -> None:
        self.stop()
