"""A decode that registers again on the connection its memory was proven on, the same incarnation
with the same endpoint, is accepted without a new challenge (nothing is mapped again); the same
register from any other connection is not: it is challenged or refused, never accepted."""

from __future__ import annotations

import time

from pdstate.protocol import wire
from pdstate.transfer.engines.shm import ShmEngine
from tests.support.hostile import RawDealer, agent_pair, agent_transfer
from tests.support.waiting import wait_until


def _reregistered(decode, address: str, since: float) -> bool:
    p = decode.prefills()[address]
    return p.state == "accepted" and p.registered_s_ago <= time.monotonic() - since


def test_the_same_incarnation_on_its_own_connection_is_not_challenged_again(monkeypatch):
    prefill, prefill_pools, decode, decode_pools, memory = agent_pair()
    issued: list[str] = []
    challenge = ShmEngine.challenge
    monkeypatch.setattr(ShmEngine, "challenge", lambda self, *a: issued.append(a[0]) or challenge(self, *a))
    try:
        agent_transfer(prefill, prefill_pools, decode, decode_pools, room=1)  # registered, proven, mapped
        assert len(issued) == 1
        mine = [(decode.worker_id, decode.incarnation)]
        t0 = time.monotonic()
        decode.reregister(prefill.address)
        wait_until("the decode accepted again", lambda: _reregistered(decode, prefill.address, t0), 15)
        assert len(issued) == 1  # accepted without a new challenge
        assert [(d.worker_id, d.incarnation) for d in prefill.decodes()] == mine
        agent_transfer(prefill, prefill_pools, decode, decode_pools, room=2)

        theirs = wire.encode(decode._handshake.register_message())  # the same register, another connection
        dealer = RawDealer(prefill.address)
        try:
            answer = dealer.ask(theirs)
        finally:
            dealer.close()
        assert isinstance(answer, (wire.Challenge, wire.Reject)), answer
        assert [(d.worker_id, d.incarnation) for d in prefill.decodes()] == mine
        agent_transfer(prefill, prefill_pools, decode, decode_pools, room=3)
    finally:
        decode.close()
        prefill.close()
        memory.close()
