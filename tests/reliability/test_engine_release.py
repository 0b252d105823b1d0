"""A prefill releases what it held for a decode that is gone, and serves a new one."""

from pdstate.worker.decode import AgentDecodeWorker
from pdstate.worker.prefill import AgentPrefillWorker
from tests.support.pools import TINY
from tests.support.waiting import wait_until
from tests.support.workers import options, transfer, wait_accepted

# Shorter than ``FAULT``'s: the prefill declares a silent decode gone after half a second.
TIMERS = dict(heartbeat_interval_s=0.1, peer_timeout_s=0.5)


def _state(p, worker_id: str) -> str | None:
    return next((x.state.value for x in p.status().peers if x.id == worker_id), None)


def test_gone_decode_is_released_and_a_new_one_is_served():
    with AgentPrefillWorker(options("prefill", TINY, **TIMERS)) as p:
        d = AgentDecodeWorker(options("decode", TINY, peer=p.endpoint, worker_id="first", **TIMERS)).start()
        wait_accepted(d)
        assert transfer(d, 300).verified
        assert [x.worker_id for x in p.agent.decodes()] == ["first"]
        d.stop()  # its goodbye-less end: silent from now on, gone after peer_timeout_s
        wait_until("the gone decode released", lambda: p.agent.decodes() == [] and _state(p, "first") == "gone", 5.0)
        with AgentDecodeWorker(options("decode", TINY, peer=p.endpoint, worker_id="second", **TIMERS)) as d2:
            wait_accepted(d2)
            assert transfer(d2, 300).verified
            assert [x.worker_id for x in p.agent.decodes()] == ["second"]
        # the decode's verdict comes before the prefill's loop ends its request (the sender's done
        # callback goes there): the pages come back soon after, not at once
        wait_until(
            "the prefill ended its request and freed its pages",
            lambda: p.in_flight() == 0 and p.free_counts() == p.page_pool.counts(),
            5.0,
        )
