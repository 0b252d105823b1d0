"""A prefill killed for good (Mooncake, a real child process): the decode's pages of its requests
stay quarantined while it is only silent (frozen), and are released once it is dead and the
horizon ``dead_prefill_release_s`` after its control session closed has passed; no byte lands in
them after that (``agent.landing``)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from pdstate.agent import DecodeAgent, RequestState
from pdstate.errors import PeerGone
from tests.agent.support import snapshot
from tests.support.bounds import within
from tests.support.engines import ENGINE_OPTIONS, require_engine
from tests.support.faults import HEARTBEAT_S, PEER_TIMEOUT_S

# a hang guard (setup included: a loaded host took 74 s to set up and 16 s to run it)
pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(300)]

HORIZON_S = 1.5
# the prefill child's silence declared after twice the faults' timeout: a live child answering late on a
# busy host is not declared gone before its first chunk lands
SILENT_S = 2 * PEER_TIMEOUT_S
DST, STATE_DST = [5, 6, 7, 8], [[1], [0], [1]]
# from the kill to the fence: the horizon, a tick and the callback on a quiet machine
FENCED_QUIET_S = HORIZON_S + 0.2


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _wait(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        assert time.monotonic() < deadline, what
        time.sleep(0.01)
    return got


def test_a_killed_prefills_pages_come_back_after_the_horizon_and_nothing_lands_in_them(prefills, sides):
    require_engine("mooncake")
    options = ENGINE_OPTIONS["mooncake"]
    _, d = sides
    pp = prefills(1, engine="mooncake", engine_options=options)
    da = DecodeAgent(
        d.kv_args,
        (d.pools.target, d.pools.draft),
        engine="mooncake",
        engine_options=options,
        heartbeat_interval_s=HEARTBEAT_S,
        peer_timeout_s=SILENT_S,
        dead_prefill_release_s=HORIZON_S,
    )
    try:
        recv = da.receiver(pp.address, 1)
        fenced_at: list[float] = []
        recv.add_fence_callback(lambda _recv: fenced_at.append(time.monotonic()))
        before = snapshot(d.kv_args)
        assert pp.ask(op="sender", room=1, num_pages=4, aux_index=0).get("raised") is None
        recv.init(DST, STATE_DST, aux_index=2)
        assert pp.ask(op="send", room=1, pages=[1, 2]).get("raised") is None  # a first chunk: it lands
        _wait(lambda: recv.metrics.get("landed"), 20, "the first chunk told landed")
        assert not _same(snapshot(d.kv_args), before)  # bytes of it are in the decode's pages

        os.kill(pp.pid, signal.SIGSTOP)  # silent, alive: it could still write
        assert recv.wait(20) is RequestState.FAILED and type(recv.failure_exception()) is PeerGone
        time.sleep(2 * HORIZON_S)  # silence alone, twice the horizon: still quarantined
        assert not recv.fenced and fenced_at == [] and da.unfenced() == 1
        assert da.quarantined_pages() == len(DST)

        image = snapshot(d.kv_args)
        killed_at = time.monotonic()
        pp.kill()  # dead for good: its control session closes, no process takes its address
        _wait(lambda: fenced_at, 20, "the fence after the horizon")
        assert fenced_at[0] - killed_at >= HORIZON_S  # not before the horizon
        within("a killed prefill's pages released", fenced_at[0] - killed_at, 10 * FENCED_QUIET_S, FENCED_QUIET_S)
        assert recv.fenced and da.unfenced() == 0 and da.quarantined_pages() == 0
        time.sleep(HORIZON_S)
        assert _same(snapshot(d.kv_args), image)  # no byte landed since the kill, none after the release
    finally:
        pp.kill()
        da.close()


@pytest.mark.parametrize("horizon", [0, -1.0])
def test_a_horizon_not_above_zero_is_refused(sides, horizon):
    _, d = sides
    with pytest.raises(ValueError, match=rf"^dead_prefill_release_s must be > 0, got {horizon!r}$"):
        DecodeAgent(d.kv_args, (d.pools.target, d.pools.draft), engine="loopback", dead_prefill_release_s=horizon)
