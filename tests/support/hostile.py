"""A hostile decode for the security suite: a raw ZeroMQ DEALER speaking the wire with its own
shared-memory pools, and helpers that forge its endpoint and read other processes' segments.

``RawDecode`` owns real ``SharedMemory`` pools (so it can be accepted like a decode) but builds
its ``Register`` by hand, so a test can point any endpoint field anywhere; ``handshake`` answers
the prefill's ownership challenge as a peer without access to other decodes' files would (real
proofs for its own segments, a guess for any other), or, with ``steal=True``, as a process of the
victim's uid that reads the victim's segment secrets. ``segment_image``
reads a segment file as it is now (the sentinel check of memory the attacker does not own).

``python -m tests.support.hostile`` is the hostile decode as a process of its own (run as another
uid where the tests run as root): it reads ``{"address", "register", "try_read"}`` (a victim's
encoded ``Register``) from stdin, registers the victim's segments under its own name, answers the
challenge (reading the segment secrets if ``try_read``, else guessing), then asks for a transfer,
and prints what it got as one JSON line. ``GatedRelay`` holds a decode's frames on their way to
its prefill until opened: a decode whose segments exist but that has not registered yet.
``RelayProcess`` is such a relay, open, as a process of its own (another uid where the tests run
as root): the fake prefill of ``test_relay.py`` run by a second user.
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

import pdstate
from pdstate.agent import DecodeAgent, PrefillAgent, RequestState
from pdstate.agent import curve as control_curve
from pdstate.pools.memory import SharedMemory, prove_segment
from pdstate.pools.presets import build_worker_pools
from pdstate.pools.reporting import build_report
from pdstate.protocol import wire
from pdstate.transfer.engines.base import create_engine
from pdstate.worker import requests as rq
from tests.support.paths import REPO, SRC_DIR
from tests.support.pools import TINY

NOBODY = 65534  # the uid a hostile process runs as when the tests run as root


def agent_request(pools, kv_args, room: int, seq_len: int) -> wire.AgentRequest:
    """A valid ``AgentRequest`` for ``seq_len`` tokens into free pages of ``pools`` (allocated to
    name them, then freed again; no digests)."""
    a = rq.allocate(pools, rq.channel_names(kv_args), seq_len)
    rq.free(pools, a)
    return wire.AgentRequest(
        room=room,
        seq_len=seq_len,
        dst_kv_pages=wire.PackedIndices.pack(a.lists[0]),
        dst_state_indices=[wire.PackedIndices.pack(x) for x in a.lists[1:]],
        deadline_s=5,
        digest=False,
    )


class RawDealer:
    """A DEALER on a prefill's control socket; ``ask`` sends one frame and reads the answer.

    It dials with the CURVE keys of this process's trust domain (``agent.curve``: from ``token``,
    else this uid's key file), as a decode of that domain would; ``curve=False``: without CURVE."""

    def __init__(
        self,
        endpoint: str,
        identity: bytes | None = None,
        token: bytes | None = None,
        curve: bool = True,
        server_public: bytes | None = None,
    ) -> None:
        self.token, self.endpoint = token, endpoint
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity or b"raw-" + secrets.token_hex(4).encode())
        if curve:  # ``server_public``: a server key given (its public key known), the client's own
            keys = control_curve.control_keys(token)
            if server_public is not None:
                keys = control_curve.Keys(server_public, b"", keys.client_public, keys.client_secret)
            control_curve.dial(self.sock, keys)
        self.monitor = self.sock.get_monitor_socket(control_curve.HANDSHAKE_EVENTS)
        self.sock.connect(endpoint)

    def send(self, msg: wire.Message | bytes) -> None:
        self.sock.send(msg if isinstance(msg, bytes) else wire.encode(msg, self.token))

    def read_until(self, until: Callable[[wire.Message], bool], timeout_s: float = 10.0) -> list[wire.Message]:
        got: list[wire.Message] = []
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            ready = dict(poller.poll(left_ms)) if left_ms > 0 else {}
            if self.monitor in ready:  # the CURVE handshake failed: nothing goes either way
                raise HandshakeFailed(zmq.Event(recv_monitor_message(self.monitor)["event"]).name)
            if self.sock not in ready:
                raise AssertionError(f"no answer within {timeout_s:g} s; replies so far: {got[-5:]}")
            got.append(wire.decode(self.sock.recv(), self.token))
            if until(got[-1]):
                return got

    def ask(self, msg: wire.Message | bytes, timeout_s: float = 10.0) -> wire.Message:
        self.send(msg)
        return self.read_until(lambda m: True, timeout_s)[-1]

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


class HandshakeFailed(AssertionError):
    """A ``RawDealer``'s CURVE handshake failed (the monitor event's name): no frame was
    delivered and none will be answered."""


class RawDecode:
    """A decode's pools and shm engine without its worker: what a forged ``Register`` needs."""

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

    def proof(self, endpoint: dict, nonce: bytes, steal: bool = False, audience: str = "") -> dict:
        """Endpoint fields answering ``nonce`` for the prefill dialled at ``audience``: real proofs
        for this decode's own segments (and, with ``steal``, for any segment this process can
        read), a random guess for the others."""
        claimant, own = f"{self.worker_id}/{self.incarnation}@{audience}", set(self.own_paths())
        proofs = {}
        for path in sorted({str(r.get("path")) for r in endpoint.get("regions", []) if isinstance(r, dict)}):
            real = None
            if path in own or steal:
                try:
                    real = prove_segment(path, nonce, claimant)
                except OSError:
                    real = None
            proofs[path] = (real or secrets.token_bytes(32)).hex()
        return {"challenge": nonce.hex(), "proofs": proofs, "audience": audience}

    def handshake(self, dealer: RawDealer, endpoint: dict | None = None, steal: bool = False, **kw) -> wire.Message:
        """Register (``register``'s arguments) and answer the prefill's challenge, if it sends one;
        returns the final answer."""
        ep = endpoint if endpoint is not None else self.endpoint
        answer = dealer.ask(self.register(ep, **kw))
        if isinstance(answer, wire.Challenge):
            answer = dealer.ask(self.register({**ep, **self.proof(ep, answer.nonce, steal, dealer.endpoint)}, **kw))
        return answer

    def request(self, room: int, seq_len: int) -> wire.AgentRequest:
        """A valid request for ``seq_len`` tokens into this decode's own free pages (a prefill
        that computes on demand, ``pdstate serve``'s, needs the token count; no digests)."""
        return agent_request(self.pools, self.kv_args, room, seq_len)

    @staticmethod
    def settle(dealer: RawDealer, reply: wire.Message) -> wire.Message:
        """Send the verdict a decode agent sends for ``reply`` (a ``TransferDone``), so the prefill
        frees the request's pages; returns ``reply``."""
        if isinstance(reply, wire.TransferDone) and reply.status == "success":
            dealer.send(wire.AgentVerdict(room=reply.room, status="success"))
        return reply

    def own_paths(self) -> list[str]:
        return sorted({str(r["path"]) for r in self.endpoint["regions"]})

    def close(self) -> None:
        self.engine.close()
        self.pools.close()


def agent_pair():
    """A prefill agent and a decode agent over the tiny preset (the decode's memory in /dev/shm)."""
    prefill_pools = pdstate.build_worker_pools(pdstate.preset("tiny"))
    memory = SharedMemory()
    decode_pools = pdstate.build_worker_pools(pdstate.preset("tiny"), memory=memory)
    prefill_kv = pdstate.fill_kv_args(prefill_pools.target, prefill_pools.draft)
    decode_kv = pdstate.fill_kv_args(decode_pools.target, decode_pools.draft)
    prefill = PrefillAgent(prefill_kv, (prefill_pools.target, prefill_pools.draft))
    decode = DecodeAgent(decode_kv, (decode_pools.target, decode_pools.draft), worker_id="victim")
    return prefill, prefill_pools, decode, decode_pools, memory


def agent_transfer(prefill, prefill_pools, decode, decode_pools, room: int) -> None:
    """Two pages and the state components, prefill -> decode, digests compared; asserts it landed."""
    src = prefill_pools.target.c4_kv_buffers[0]
    src[1:3] = torch.randint(0, 256, src[1:3].shape, dtype=torch.uint8)
    recv = decode.receiver(prefill.address, room=room)
    recv.init([3, 4], [[1], [0], [1]])
    send = prefill.sender(room=room, num_pages=2)
    send.send([1])
    send.send([2], state_indices=[[2], [1], [2]])
    assert recv.wait(15) is RequestState.SUCCESS, recv.failure_exception()
    assert send.wait(15) is RequestState.SUCCESS, send.failure_exception()
    assert torch.equal(decode_pools.target.c4_kv_buffers[0][3:5], src[1:3])


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


def bound_router() -> zmq.Socket:
    """A ROUTER bound on 127.0.0.1 (port 0): a relay's front, its address known before its
    upstream; a CURVE server of this process's trust domain (``curve_router``)."""
    sock = curve_router(zmq.Context.instance())
    sock.bind_to_random_port("tcp://127.0.0.1")
    return sock


def curve_router(ctx: zmq.Context, token: bytes | None = None) -> zmq.Socket:
    """A ROUTER (not bound) that is a CURVE server of this process's trust domain: keys from
    ``token``, else from this uid's key file. Without a ZAP handler in ``ctx`` it takes any
    client that knows the domain's server key (what a peer that holds the secret can do)."""
    sock = ctx.socket(zmq.ROUTER)
    control_curve.serve(sock, control_curve.control_keys(token))
    return sock


class GatedRelay:
    """A ROUTER on 127.0.0.1 (port 0, ``front``, or bound at ``front_bind``: a loopback alias such
    as ``tcp://127.0.0.2:P``) for one decode, relaying to ``upstream`` through a DEALER that
    redials every ``reconnect_ivl_ms`` (ZeroMQ's default: 100) while nothing listens there: the
    decode's frames are held (dropped, counted, the last one kept) until ``open`` is set; the
    prefill's answers go back. With ``inject`` (an encoded frame, an ``AgentRequest``), once the
    prefill answered the relayed proof (``accept`` or ``reject``) the relay sends ``inject`` as
    the decode it relayed and keeps the first answer to it (``injected``, its kind and error type;
    set once it came) to itself. The relay's thread alone uses its sockets."""

    def __init__(
        self,
        upstream: str,
        front: zmq.Socket | None = None,
        front_bind: str | None = None,
        reconnect_ivl_ms: int | None = None,
        inject: bytes | None = None,
    ) -> None:
        ctx = zmq.Context.instance()
        self.front, self.back = front or curve_router(ctx), ctx.socket(zmq.DEALER)
        control_curve.dial(self.back, control_curve.control_keys(None))  # this process's uid's keys
        for sock in (self.front, self.back):
            sock.setsockopt(zmq.LINGER, 0)
        if reconnect_ivl_ms is not None:
            self.back.setsockopt(zmq.RECONNECT_IVL, reconnect_ivl_ms)
        if front_bind is not None:
            self.front.bind(front_bind)
        elif front is None:
            self.front.bind_to_random_port("tcp://127.0.0.1")
        self.address = self.front.getsockopt_string(zmq.LAST_ENDPOINT)
        self.back.connect(upstream)
        self.open, self._stop, self.answered = threading.Event(), threading.Event(), threading.Event()
        self.held: list[bytes] = []
        self.frames = 0  # frames the decode's connection delivered to the front
        self.inject, self.injected = inject, None
        self._thread = threading.Thread(target=self._run, name="gated-relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        identity, sent = None, False
        while not self._stop.is_set():
            for sock, _ in poller.poll(20):
                if sock is self.front:
                    identity, frame = self.front.recv_multipart()
                    self.frames += 1
                    if self.open.is_set():
                        self.back.send(frame)
                    else:
                        self.held.append(frame)
                    continue
                frame = self.back.recv()
                kind = wire.envelope_kind(frame)
                if sent:  # an answer to the injected request: the relay's own
                    if kind != "heartbeat" and self.injected is None:
                        msg = wire.decode(frame)
                        self.injected = {"kind": kind, "error": getattr(getattr(msg, "error", None), "type", None)}
                        self.answered.set()
                    continue
                if identity is not None:
                    self.front.send_multipart([identity, frame])
                if self.inject is not None and kind in ("accept", "reject"):
                    self.back.send(self.inject)
                    sent = True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.front.close(0)
        self.back.close(0)


def claim(address: str, theirs: wire.Register, try_read: bool, server_public: bytes | None = None) -> dict:
    """Register ``theirs``'s segments as decode ``attacker``; what came back, as JSON data."""
    ep = {**theirs.engine.endpoint, "engine_id": secrets.token_hex(8)}
    incarnation = secrets.token_hex(8)
    ours = theirs.model_copy(
        update={"worker_id": "attacker", "incarnation": incarnation, "engine": wire.EngineDesc(name="shm", endpoint=ep)}
    )
    out: dict = {"answers": [], "read_error": None, "handshake_failed": None}
    dealer = RawDealer(address, server_public=server_public)
    try:
        try:
            answer = dealer.ask(ours)
        except HandshakeFailed as exc:  # not of the prefill's trust domain: nothing was delivered
            out["handshake_failed"] = str(exc)
            return out
        out["answers"].append(answer.KIND)
        if isinstance(answer, wire.Challenge):
            proofs = {}
            for path in sorted({str(r["path"]) for r in ep["regions"]}):
                real = None
                if try_read:
                    try:
                        real = prove_segment(path, answer.nonce, f"attacker/{incarnation}@{address}")
                    except OSError as exc:
                        out["read_error"] = type(exc).__name__
                proofs[path] = (real or secrets.token_bytes(32)).hex()
            proven = {**ep, "challenge": answer.nonce.hex(), "proofs": proofs, "audience": address}
            answer = dealer.ask(ours.model_copy(update={"engine": wire.EngineDesc(name="shm", endpoint=proven)}))
            out["answers"].append(answer.KIND)
        if isinstance(answer, wire.Reject):
            out["error"] = answer.error.model_dump()
        n = len(theirs.kv.components) if theirs.kv is not None else 0
        request = wire.AgentRequest(
            room=1,
            seq_len=256,
            dst_kv_pages=wire.PackedIndices.pack([1]),
            dst_state_indices=[wire.PackedIndices.pack([1])] * n,
            deadline_s=5,
            digest=False,
        )
        then = dealer.ask(request)
        out["request"] = then.error.model_dump() if isinstance(then, wire.Error) else then.KIND
    finally:
        dealer.close()
    return out


def reuse_identity(address: str, theirs: wire.Register, identity: bytes) -> dict:
    """The victim's own register, sent from a copy of its ZeroMQ identity and then from a new
    connection; what came back, as JSON data."""
    copied, fresh = RawDealer(address, identity), RawDealer(address)
    try:
        copied.send(theirs)
        out: dict = {"copied_identity_answered": bool(copied.sock.poll(500))}
        answer = fresh.ask(theirs)
        out["answer"] = answer.KIND
        if isinstance(answer, wire.Reject):
            out["error"] = answer.error.model_dump()
        return out
    finally:
        copied.close()
        fresh.close()


def run(spec: dict, as_other_uid: bool = False) -> dict:
    """Run this module as a process on ``spec`` (as another uid, ``NOBODY``, when asked and
    running as root: it drops to it before touching the network); returns its JSON answer."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC_DIR), str(REPO)])}
    if as_other_uid and os.getuid() == 0:
        spec = {**spec, "uid": NOBODY}  # dropped once imported (the interpreter may be root's alone)
    r = subprocess.run(
        [sys.executable, "-B", "-m", "tests.support.hostile"],
        input=json.dumps(spec) + "\n",
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


class RelayProcess:
    """An open ``GatedRelay`` to ``upstream`` in a process of its own, as ``NOBODY`` when the tests
    run as root; ``address`` its front, ``uid`` the uid it runs as. ``front_bind``,
    ``reconnect_ivl_ms`` and ``inject`` as ``GatedRelay`` takes them; ``injected(timeout_s)``: the
    answer to the injected frame (``{"kind", "error"}``), or None when none came in time.
    ``close`` ends it."""

    def __init__(
        self,
        upstream: str,
        as_other_uid: bool = True,
        front_bind: str | None = None,
        reconnect_ivl_ms: int | None = None,
        inject: bytes | None = None,
    ) -> None:
        spec = {
            "relay": upstream,
            "uid": NOBODY if as_other_uid and os.getuid() == 0 else None,
            "front": front_bind,
            "reconnect_ivl_ms": reconnect_ivl_ms,
            "inject": None if inject is None else inject.hex(),
        }
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC_DIR), str(REPO)])}
        self.proc = subprocess.Popen(
            [sys.executable, "-B", "-m", "tests.support.hostile"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()  # once listening (or empty: it died, see its stderr)
        assert line, f"the relay process ended: {self.proc.wait(10)}"
        started = json.loads(line)
        self.address, self.uid = started["address"], started["uid"]

    def injected(self, timeout_s: float) -> dict | None:
        return self._ask(timeout_s)["injected"]

    def frames(self) -> int:
        """How many frames the relay's front received (from the decodes that dialled it)."""
        return self._ask(0.0)["frames"]

    def _ask(self, wait_s: float) -> dict:
        self.proc.stdin.write(json.dumps({"wait_s": wait_s}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()  # the relay's cue to stop
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _relay(spec: dict) -> None:
    inject = None if spec.get("inject") is None else bytes.fromhex(spec["inject"])
    relay = GatedRelay(
        spec["relay"], front_bind=spec.get("front"), reconnect_ivl_ms=spec.get("reconnect_ivl_ms"), inject=inject
    )
    relay.open.set()
    print(json.dumps({"address": relay.address, "uid": os.getuid()}), flush=True)
    for line in sys.stdin:  # until the test closes it; a line asks for the injected frame's answer
        relay.answered.wait(json.loads(line)["wait_s"])
        print(json.dumps({"injected": relay.injected, "frames": relay.frames}), flush=True)
    relay.close()


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    if spec.get("uid") is not None:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
        os.environ.pop("XDG_RUNTIME_DIR", None)  # its own key file, not the tests' user's (``agent.curve``)
    if spec.get("relay"):
        _relay(spec)
        return
    theirs = wire.decode(bytes.fromhex(spec["register"]))
    if spec.get("identity"):
        out = reuse_identity(spec["address"], theirs, bytes.fromhex(spec["identity"]))
    else:
        server_public = spec.get("server_public")
        out = claim(spec["address"], theirs, bool(spec.get("try_read")), server_public and server_public.encode())
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
