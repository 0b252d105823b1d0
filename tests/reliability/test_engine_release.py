"""A prefill releases the engine state of a decode that is gone (no mapping kept per crash)."""

import time

from pdstate.pools.presets import preset
from pdstate.runtime.common import WorkerOptions
from pdstate.runtime.decode import DecodeWorker
from pdstate.runtime.prefill import PrefillWorker


def _wait(pred, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_gone_decode_engine_peer_is_released_and_a_new_one_is_served():
    s = preset("tiny")
    fast = dict(heartbeat_interval_s=0.1, peer_timeout_s=0.5)
    p = PrefillWorker(WorkerOptions(role="prefill", pool=s, **fast)).start()
    try:
        d = DecodeWorker(WorkerOptions(role="decode", pool=s, peer=p.endpoint, **fast)).start()
        d.wait_ready(10)
        assert d.transfer(300).verified
        assert p.engine.num_peers == 1
        d.stop()  # silent from now on: the prefill declares it gone after peer_timeout_s
        assert _wait(lambda: p.engine.num_peers == 0, 5.0), "engine peer of the gone decode kept"
        d2 = DecodeWorker(WorkerOptions(role="decode", pool=s, peer=p.endpoint, **fast)).start()
        try:
            d2.wait_ready(10)
            assert d2.transfer(300).verified
            assert p.engine.num_peers == 1
        finally:
            d2.stop()
    finally:
        p.stop()
