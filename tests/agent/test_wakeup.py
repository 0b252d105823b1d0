"""The prefill notices a landed request when the engine says so: no tick, no polling meanwhile."""

from __future__ import annotations

import time

import pytest

from pdstate.agent import DecodeAgent, PrefillAgent, RequestState
from pdstate.agent.common import AgentLoop
from tests.agent.support import assert_images_equal, expected, fill, make_side, snapshot
from tests.support.engines import ENGINE_OPTIONS, require_engine

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(60)]


def test_mooncake_landing_wakes_the_prefill_without_a_tick(monkeypatch):
    require_engine("mooncake")
    monkeypatch.setattr(PrefillAgent, "_tick", lambda self: None)  # no periodic check at all
    polled: list[object] = []
    monkeypatch.setattr(AgentLoop, "again", lambda self, key, check: polled.append(key))  # nor a quick poll
    p, d = make_side(False), make_side(False)
    fill(p.kv_args, 1)
    fill(d.kv_args, 2)
    options = ENGINE_OPTIONS["mooncake"]
    pa = PrefillAgent(p.kv_args, (p.pools.target, p.pools.draft), engine="mooncake", engine_options=options)
    da = DecodeAgent(d.kv_args, (d.pools.target, d.pools.draft), engine="mooncake", engine_options=options)
    src, before = snapshot(p.kv_args), snapshot(d.kv_args)
    try:
        recv, send = da.receiver(pa.address, 3), pa.sender(3, 2)
        recv.init([3, 4], [[1], [0], [1]])
        send.send([1])
        deadline = time.monotonic() + 20
        while recv.metrics.get("landed") != 1:  # the first chunk told landed (digest on), woken by the engine
            assert time.monotonic() < deadline, recv.metrics
            time.sleep(0.005)
        send.send([2], [[2], [1], [2]])
        assert recv.wait(20) is RequestState.SUCCESS, recv.failure_exception()
        assert send.wait(20) is RequestState.SUCCESS, send.failure_exception()
        assert send.landed and send.metrics["chunks"] == 2 and polled == []
        # the last chunk's state goes first and is told landed, its main KV by TransferDone; when
        # the main KV has landed too by the time the prefill is woken, TransferDone tells both
        # (a Landed for all of the request is never sent)
        assert recv.metrics["landed"] in (1, 2)
        moves = [(0, [1, 2], [3, 4]), (1, [2], [1]), (2, [1], [0]), (3, [2], [1])]
        assert_images_equal(snapshot(d.kv_args), expected(before, src, d.kv_args, moves))
    finally:
        da.close()
        pa.close()
        p.close()
        d.close()
