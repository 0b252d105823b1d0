"""Loopback engine: scripted failures, simulated delay, notifications, vanished peer."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from pdstate.pools.memory import BufferSpec, PrivateMemory
from pdstate.transfer.engines import EngineError, TransferTimedOut
from pdstate.transfer.engines.loopback import LoopbackEngine, ScriptedFailure
from pdstate.transfer.plan import TransferPlan
from tests.support.images import SENTINEL

pytestmark = pytest.mark.timeout(30)


class Rig:
    def __init__(self, prefill: LoopbackEngine) -> None:
        self.memory = PrivateMemory()
        (self.src,) = self.memory.allocate("src", [BufferSpec("b", (4096,), torch.uint8)])
        (self.dst,) = self.memory.allocate("dst", [BufferSpec("b", (4096,), torch.uint8)])
        self.src.copy_(torch.arange(4096, dtype=torch.int64).remainder(251).to(torch.uint8))
        self.dst.fill_(SENTINEL)
        src_region, dst_region = self.memory.regions()
        self.decode = LoopbackEngine()
        self.decode.start()
        self.decode.register([dst_region])
        self.prefill = prefill
        prefill.start()
        prefill.register([src_region])
        self.peer_id = prefill.connect(self.decode.endpoint())

    def plan(self, rows: list[tuple[int, int, int]]) -> TransferPlan:
        s, d, n = np.array(rows, dtype=np.uint64).reshape(-1, 3).T
        return TransferPlan.from_arrays(s + self.src.data_ptr(), d + self.dst.data_ptr(), n)

    def dst_bytes(self) -> np.ndarray:
        return self.dst.numpy().copy()

    def expect(self, copies: list[tuple[int, int, int]]) -> np.ndarray:
        out = np.full(4096, SENTINEL, dtype=np.uint8)
        for s, d, n in copies:
            out[d : d + n] = self.src.numpy()[s : s + n]
        return out

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


@pytest.fixture
def make_rig() -> Iterator:
    rigs: list[Rig] = []

    def make(**options) -> Rig:
        rigs.append(Rig(LoopbackEngine(**options)))
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()


ROWS = [(0, 0, 100), (100, 1000, 100), (200, 2000, 100)]


def test_scripted_failure_writes_a_prefix_then_raises_on_wait(make_rig) -> None:
    rig = make_rig()
    rig.prefill.script_failure(nth_submit=2, after_bytes=150, message="link down")
    rig.prefill.wait(rig.prefill.submit(rig.peer_id, rig.plan(ROWS[:1])), 1.0)
    handle = rig.prefill.submit(rig.peer_id, rig.plan(ROWS[1:]))
    with pytest.raises(EngineError, match="^link down$"):
        rig.prefill.wait(handle, 1.0)
    with pytest.raises(EngineError, match="^link down$"):
        rig.prefill.poll(handle)  # the same failure, every time
    # submit 1 landed; submit 2 wrote its first descriptor and half of its second
    assert np.array_equal(rig.dst_bytes(), rig.expect([ROWS[0], ROWS[1], (200, 2000, 50)]))
    rig.prefill.wait(rig.prefill.submit(rig.peer_id, rig.plan(ROWS)), 1.0)  # submit 3 works
    assert np.array_equal(rig.dst_bytes(), rig.expect(ROWS))
    assert rig.prefill.num_submits == 3


def test_scripted_failure_on_submit_raises_from_submit(make_rig) -> None:
    rig = make_rig(failures=[ScriptedFailure(nth_submit=1, message="refused", on_submit=True)])
    with pytest.raises(EngineError, match="^refused$"):
        rig.prefill.submit(rig.peer_id, rig.plan(ROWS))
    assert np.array_equal(rig.dst_bytes(), rig.expect([]))


def test_delay_keeps_the_transfer_pending_until_due(make_rig) -> None:
    rig = make_rig(delay_s=0.3)
    handle = rig.prefill.submit(rig.peer_id, rig.plan(ROWS))
    assert rig.prefill.poll(handle) is False
    with pytest.raises(TransferTimedOut, match=r"timed out after 0.01 s \(3 descriptors, 300 bytes\)"):
        rig.prefill.wait(handle, 0.01)
    assert np.array_equal(rig.dst_bytes(), rig.expect([]))  # nothing landed yet
    rig.prefill.wait(handle, 5.0)
    assert np.array_equal(rig.dst_bytes(), rig.expect(ROWS))


def test_notification_names_the_sender(make_rig) -> None:
    rig = make_rig()
    rig.prefill.wait(rig.prefill.submit(rig.peer_id, rig.plan(ROWS), notify=b"req-1"), 1.0)
    assert rig.decode.notifications() == [(f"loopback:{rig.prefill.endpoint()['engine_id']}", b"req-1")]
    assert rig.decode.notifications() == []


def test_closed_peer_fails_the_transfer(make_rig) -> None:
    rig = make_rig()
    rig.decode.close()
    with pytest.raises(EngineError, match="the peer engine was closed"):
        rig.prefill.wait(rig.prefill.submit(rig.peer_id, rig.plan(ROWS)), 1.0)


def test_connect_to_unknown_engine_fails(make_rig) -> None:
    rig = make_rig()
    with pytest.raises(EngineError, match="is not live in this process"):
        rig.prefill.connect({**rig.decode.endpoint(), "engine_id": "feedface"})
