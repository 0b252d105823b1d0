"""A prefill releases the engine state of a decode that is gone (no mapping kept per crash)."""

from pdstate.runtime.decode import DecodeWorker
from pdstate.runtime.prefill import PrefillWorker
from tests.support.pools import TINY
from tests.support.waiting import wait_until
from tests.support.workers import options

# Shorter than ``FAULT``'s: the prefill declares a silent decode gone after half a second.
TIMERS = dict(heartbeat_interval_s=0.1, peer_timeout_s=0.5)


def test_gone_decode_engine_peer_is_released_and_a_new_one_is_served():
    p = PrefillWorker(options("prefill", TINY, **TIMERS)).start()
    try:
        d = DecodeWorker(options("decode", TINY, peer=p.endpoint, **TIMERS)).start()
        d.wait_ready(10)
        assert d.transfer(300).verified
        assert p.engine.num_peers == 1
        d.stop()  # silent from now on: the prefill declares it gone after peer_timeout_s
        wait_until("the engine peer of the gone decode released", lambda: p.engine.num_peers == 0, 5.0)
        d2 = DecodeWorker(options("decode", TINY, peer=p.endpoint, **TIMERS)).start()
        try:
            d2.wait_ready(10)
            assert d2.transfer(300).verified
            assert p.engine.num_peers == 1
        finally:
            d2.stop()
    finally:
        p.stop()
