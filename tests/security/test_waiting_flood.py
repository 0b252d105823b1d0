"""A registered decode that floods a prefill with requests for rooms no sender exists for (a hostile
or buggy decode): past ``agent.refusals.MAX_WAITING_REQUESTS`` waiting, each new room is refused
at once with a failed ``TransferDone`` naming the bound, and counted (``waiting_refused``,
``pdstate_waiting_refused_total``); the prefill keeps serving (a raw decode over real sockets,
the prefill agent in this process with the bound lowered)."""

from __future__ import annotations

import pytest
import torch

from pdstate.agent import RequestState, refusals
from pdstate.protocol import wire
from tests.support.hostile import RawDealer, RawDecode, agent_pair

pytestmark = pytest.mark.timeout(60)

BOUND = 8


def test_rooms_past_the_bound_are_refused_at_once_and_counted(monkeypatch):
    monkeypatch.setattr(refusals, "MAX_WAITING_REQUESTS", BOUND)
    flood = RawDecode(worker_id="flood")
    prefill, prefill_pools, decode, decode_pools, memory = agent_pair()
    dealer = RawDealer(prefill.address)
    try:
        assert isinstance(flood.handshake(dealer), wire.Accept)
        for room in range(1000, 1000 + BOUND):  # they wait for senders that never come
            dealer.send(flood.request(room, 256))
        refused = [dealer.ask(flood.request(room, 256)) for room in (2000, 2001)]
        want = "{} requests already wait for their sender on this prefill"
        assert [(m.room, m.status, m.error.type, m.error.message) for m in refused] == [
            (room, "failed", "TransferFailed", f"room {room}: refused: " + want.format(BOUND)) for room in (2000, 2001)
        ]
        assert all(m.bytes == 0 for m in refused)  # nothing of it copied: its pages are the decode's at once
        assert prefill.waiting_refused == 2
        assert all(prefill.requested(room) for room in range(1000, 1000 + BOUND)) and not prefill.requested(2000)
        # the prefill still serves another decode: a room whose sender exists first never waits
        send = prefill.sender(room=3000, num_pages=2)
        recv = decode.receiver(prefill.address, room=3000)
        recv.init([3, 4], [[1], [0], [1]])
        send.send([1])
        send.send([2], state_indices=[[2], [1], [2]])
        assert recv.wait(15) is RequestState.SUCCESS, recv.failure_exception()
        assert torch.equal(decode_pools.target.c4_kv_buffers[0][3:5], prefill_pools.target.c4_kv_buffers[0][1:3])
    finally:
        dealer.close()
        flood.close()
        decode.close()
        prefill.close()
        memory.close()
