"""A prefill answers only for the requests sent to it.

A decode that uses two prefills keys its requests by room; a prefill that sends ``TransferDone``,
``Error`` or ``Busy`` naming a room the decode sent to *another* prefill must change nothing of
that request (it would otherwise mark unverified pages done, or end another prefill's request).
Here the second prefill is a raw ROUTER that accepts the decode's handshake and then forges
answers; the first is ``pdstate serve``'s prefill worker whose copy waits a second (fault injection) so the
forgeries arrive while its request is in flight. A forged success would fail verification (no
byte was copied) and a forged error would fail it outright: only an untouched request succeeds.
"""

from __future__ import annotations

import secrets

import zmq

from pdstate.protocol import wire
from pdstate.protocol.report import ErrorInfo
from pdstate.worker.decode import AgentDecodeWorker
from pdstate.worker.prefill import AgentPrefillWorker
from tests.support.faults import holding_hooks
from tests.support.hostile import curve_router
from tests.support.pools import ROOMY
from tests.support.waiting import wait_until
from tests.support.workers import options, wait_accepted


class RogueRouter:
    """A ROUTER that accepts any decode's register with the decode's own report, then says what
    the test tells it to."""

    def __init__(self) -> None:
        self.sock = curve_router(zmq.Context.instance())  # a fake prefill of the decode's trust domain
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.identity: bytes | None = None

    def recv(self, kind: type[wire.Message], timeout_s: float = 10.0) -> wire.Message:
        def got():
            if not self.sock.poll(50):
                return None
            identity, frame = self.sock.recv_multipart()
            msg = wire.decode(frame, None)
            self.identity = identity
            return msg if isinstance(msg, kind) else None

        return wait_until(f"a {kind.__name__} on the rogue prefill", got, timeout_s)

    def send(self, msg: wire.Message) -> None:
        self.sock.send_multipart([self.identity, wire.encode(msg, None)])

    def accept(self) -> None:
        reg = self.recv(wire.Register)
        self.send(
            wire.Accept(
                worker_id="rogue",
                incarnation=secrets.token_hex(8),
                report=reg.report,
                heartbeat_interval_s=0.2,
                peer_timeout_s=30.0,
            )
        )

    def close(self) -> None:
        self.sock.close(0)


def test_a_prefill_cannot_answer_for_another_prefills_request():
    prefill = AgentPrefillWorker(options("prefill", ROOMY), hooks=holding_hooks(1.0)).start()
    rogue = RogueRouter()
    decode = None
    try:
        decode = AgentDecodeWorker(options("decode", ROOMY, peer=prefill.status().endpoint)).start()
        wait_accepted(decode)
        held = decode.submit(300, room=11)  # the real prefill's copy waits a second
        wait_until("room 11 on the prefill", lambda: prefill.in_flight() == 1, 10)
        asked = decode.submit(200, room=22, prefill=rogue.endpoint)
        rogue.accept()
        sent = rogue.recv(wire.AgentRequest)
        assert sent.room == 22 and sent.seq_len == 200
        # forgeries naming room 11, which went to the real prefill
        rogue.send(wire.TransferDone(room=11, status="success", bytes=1, descriptors=1))
        rogue.send(wire.Error(error=ErrorInfo(type="TransferFailed", message="forged"), room=11))
        rogue.send(wire.Busy(room=11, in_flight=4, limit=4))
        # its own request, failed by it: that one ends with its error
        rogue.send(wire.TransferDone(room=22, status="failed", error=ErrorInfo(type="EngineError", message="rogue")))
        res = asked.result(10)
        assert res.status == "failed" and res.prefill == rogue.endpoint
        assert res.error == ErrorInfo(type="EngineError", message="rogue")
        assert decode.stats.snapshot().transfers["busy"] == 0  # the forged Busy was not counted against room 11
        res = held.result(20)
        assert res.status == "success" and res.verified and res.error is None
        assert res.bytes > 1 and res.prefill == prefill.status().endpoint
        peers = {p.id: p for p in decode.status().peers}
        assert peers[rogue.endpoint].state.value == "accepted" and peers[rogue.endpoint].fingerprint
    finally:
        if decode is not None:
            decode.stop()
        prefill.stop()
        rogue.close()
