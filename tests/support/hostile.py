"""A hostile decode for the security suite: a raw ZeroMQ DEALER speaking the wire with its own
shared-memory pools, and helpers that forge its endpoint and read other processes' segments.

``RawDecode`` owns real ``SharedMemory`` pools (so it can be accepted like a decode) but builds
its ``Register`` by hand, so a test can point any endpoint field anywhere; ``handshake`` answers
the prefill's ownership challenge as a peer without access to other decodes' files would (real
proofs for its own segments, a guess for any other), or, with ``steal=True``, as a process of the
victim's uid that reads the victim's segment secrets. ``segment_image``
reads a segment file as it is now (the sentinel check of memory the attacker does not own).
"""

from __future__ import annotations

import glob
import secrets
import time
from collections.abc import Callable

import numpy as np
import zmq

from pdstate.pools.memory import SharedMemory, prove_segment
from pdstate.pools.presets import build_worker_pools
from pdstate.pools.reporting import build_report
from pdstate.protocol import wire
from pdstate.runtime import requests as rq
from pdstate.transfer.engines.base import create_engine
from tests.support.pools import TINY


class RawDealer:
    """A DEALER on a prefill's control socket; ``ask`` sends one frame and reads the answer."""

    def __init__(self, endpoint: str, identity: bytes | None = None, token: bytes | None = None) -> None:
        self.token = token
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity or b"raw-" + secrets.token_hex(4).encode())
        self.sock.connect(endpoint)

    def send(self, msg: wire.Message | bytes) -> None:
        self.sock.send(msg if isinstance(msg, bytes) else wire.encode(msg, self.token))

    def read_until(self, until: Callable[[wire.Message], bool], timeout_s: float = 10.0) -> list[wire.Message]:
        got: list[wire.Message] = []
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.sock.poll(left_ms):
                raise AssertionError(f"no answer within {timeout_s:g} s; replies so far: {got[-5:]}")
            got.append(wire.decode(self.sock.recv(), self.token))
            if until(got[-1]):
                return got

    def ask(self, msg: wire.Message | bytes, timeout_s: float = 10.0) -> wire.Message:
        self.send(msg)
        return self.read_until(lambda m: True, timeout_s)[-1]

    def close(self) -> None:
        self.sock.close(0)


class RawDecode:
    """A decode's pools and shm engine without its runtime: what a forged ``Register`` needs."""

    def __init__(self, settings=TINY, worker_id: str = "attacker") -> None:
        self.worker_id = worker_id
        self.incarnation = secrets.token_hex(8)
        self.memory = SharedMemory()
        self.pools = build_worker_pools(settings, self.memory)
        self.report, self.kv_args = build_report(self.pools.target, self.pools.draft)
        self.engine = create_engine("shm")
        self.engine.start()
        self.engine.register(self.memory.regions())
        self.endpoint = self.engine.endpoint()

    def register(self, endpoint: dict | None = None, kv: wire.KVDesc | None = None, **kw) -> wire.Register:
        fields = dict(
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            role="decode",
            report=self.report,
            kv=kv or wire.KVDesc.of(self.kv_args),
            engine=wire.EngineDesc(name="shm", endpoint=endpoint if endpoint is not None else self.endpoint),
        )
        return wire.Register(**{**fields, **kw})

    def proof(self, endpoint: dict, nonce: bytes, steal: bool = False) -> dict:
        """Endpoint fields answering ``nonce``: real proofs for this decode's own segments (and,
        with ``steal``, for any segment this process can read), a random guess for the others."""
        claimant, own = f"{self.worker_id}/{self.incarnation}", set(self.own_paths())
        proofs = {}
        for path in sorted({str(r.get("path")) for r in endpoint.get("regions", []) if isinstance(r, dict)}):
            real = None
            if path in own or steal:
                try:
                    real = prove_segment(path, nonce, claimant)
                except OSError:
                    real = None
            proofs[path] = (real or secrets.token_bytes(32)).hex()
        return {"challenge": nonce.hex(), "proofs": proofs}

    def handshake(self, dealer: RawDealer, endpoint: dict | None = None, steal: bool = False, **kw) -> wire.Message:
        """Register (``register``'s arguments) and answer the prefill's challenge, if it sends one;
        returns the final answer."""
        ep = endpoint if endpoint is not None else self.endpoint
        answer = dealer.ask(self.register(ep, **kw))
        if isinstance(answer, wire.Challenge):
            answer = dealer.ask(self.register({**ep, **self.proof(ep, answer.nonce, steal)}, **kw))
        return answer

    def request(self, room: int, seq_len: int) -> wire.TransferRequest:
        """A valid request for ``seq_len`` tokens into this decode's own free pages."""
        a = rq.allocate(self.pools, rq.channel_names(self.kv_args), seq_len)
        rq.free(self.pools, a)
        return wire.TransferRequest(
            room=room,
            seq_len=seq_len,
            dst_kv_pages=wire.PackedIndices.pack(a.lists[0]),
            dst_state_indices=[wire.PackedIndices.pack(x) for x in a.lists[1:]],
            deadline_s=5,
        )

    def own_paths(self) -> list[str]:
        return sorted({str(r["path"]) for r in self.endpoint["regions"]})

    def close(self) -> None:
        self.engine.close()
        self.pools.close()


def segment_paths(pid: int) -> list[str]:
    return sorted(glob.glob(f"/dev/shm/pdstate-{pid}-*"))


def segment_image(paths: list[str]) -> dict[str, bytes]:
    """The bytes of each segment file now."""
    out = {}
    for p in paths:
        with open(p, "rb") as f:
            out[p] = f.read()
    return out


def changed_bytes(before: dict[str, bytes], after: dict[str, bytes]) -> int:
    """Bytes that differ between two images of the same segments."""
    n = 0
    for p, old in before.items():
        new = after[p]
        k = min(len(old), len(new))
        a, b = np.frombuffer(old, np.uint8)[:k], np.frombuffer(new, np.uint8)[:k]
        n += int(np.count_nonzero(a != b)) + abs(len(old) - len(new))
    return n


def with_paths(endpoint: dict, mapping: Callable[[str], str]) -> dict:
    """``endpoint`` with each region's segment path replaced by ``mapping(path)``."""
    regions = [{**r, "path": mapping(str(r["path"]))} for r in endpoint["regions"]]
    return {**endpoint, "regions": regions}


def with_region(endpoint: dict, i: int, **fields) -> dict:
    regions = [dict(r) for r in endpoint["regions"]]
    regions[i].update(fields)
    return {**endpoint, "regions": regions}
