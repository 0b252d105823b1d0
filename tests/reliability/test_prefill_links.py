"""A decode's table of prefill links stays bounded: an idle link makes room for a new prefill, and
when every link is busy a request naming yet another prefill fails at once with the reason.

In-process ``AgentDecodeWorker`` (its default prefill a real ``AgentPrefillWorker``) with the bound
lowered to two links; the other prefills are addresses nothing answers on (their requests wait for
a handshake answer until their deadline).
"""

from __future__ import annotations

import zmq

from pdstate.worker import decode as decode_worker
from tests.support.waiting import wait_until
from tests.support.workers import served_pair, transfer


def _silent_address() -> str:
    """A bound-then-closed port on 127.0.0.1: nothing answers there."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:0")
    address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.close(0)
    return address


def test_links_are_bounded_and_idle_ones_make_room(monkeypatch):
    monkeypatch.setattr(decode_worker, "MAX_PREFILLS", 2)
    silent = [_silent_address() for _ in range(3)]
    with served_pair() as (p, d):
        held = d.submit(10, prefill=silent[0], deadline_s=8)  # keeps the second link busy
        wait_until("a link to the first silent prefill", lambda: len(d.status().peers) == 2)
        full = transfer(d, 10, prefill=silent[1], timeout_s=10)
        assert full.status == "failed" and full.prefill == silent[1]
        assert full.error.type == "TooManyPrefills"  # a PeerGone
        assert full.error.message == "this decode already uses 2 prefills, each with requests in flight"
        assert transfer(d, 300).verified  # the default prefill is untouched
        res = held.result(20)
        assert res.status == "failed" and res.error.message == (
            f"deadline exceeded: no handshake answer from the prefill at {silent[0]}"
        )
        # the first silent prefill's link is idle now: it makes room for another prefill
        res = transfer(d, 10, prefill=silent[2], deadline_s=0.5)
        assert res.error.message == f"deadline exceeded: no handshake answer from the prefill at {silent[2]}"
        assert [x.id for x in d.status().peers] == [p.endpoint, silent[2]]
        assert transfer(d, 300).verified
