"""The transfer-engine contract, run unchanged over every engine (see ``engines/base.py``).

Every test compares the WHOLE destination (both regions) with the expectation, so bytes outside
the plan must keep the 0xA5 sentinel.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest

from pdstate.transfer.engines import (
    DescriptorOutOfRange,
    EngineError,
    EngineStateError,
    InvalidEndpoint,
    TransferStatus,
    UnknownPeer,
    create_engine,
)
from pdstate.transfer.plan import TransferPlan
from tests.support.bounds import within
from tests.support.decode_peer import DST_SIZES, LocalDecode, RemoteDecode
from tests.support.engines import (
    DETECTS_PEER_LOSS,
    ENGINE_OPTIONS,
    ENGINE_PARAMS,
    SRC_SIZES,
    Descs,
    Pair,
    Source,
    new_decode,
    proven,
    require_engine,
)

pytestmark = pytest.mark.timeout(60)
# A copy or connect to a gone peer fails, not hangs: what that took on a quiet machine (the bounds,
# tests.support.bounds, are far above it and under the test's timeout)
QUIET_FAIL_S = 1.0


# --- fixtures: one decode side per engine (module), a fresh prefill per test ----------------------


@pytest.fixture(scope="module", params=ENGINE_PARAMS)
def engine_name(request: pytest.FixtureRequest) -> str:
    require_engine(request.param)
    return request.param


@pytest.fixture(scope="module")
def decode(engine_name: str) -> Iterator[LocalDecode | RemoteDecode]:
    side = new_decode(engine_name)
    yield side
    side.close()


@pytest.fixture
def fresh_decode(engine_name: str) -> Iterator[LocalDecode | RemoteDecode]:
    """A decode side of its own, for tests that stop or kill it."""
    side = new_decode(engine_name)
    yield side
    side.close()


@pytest.fixture(scope="session")
def source() -> Iterator[Source]:
    s = Source.random()
    yield s
    s.memory.close()


@pytest.fixture(scope="module")
def _module_pair(engine_name: str, source: Source, decode: LocalDecode | RemoteDecode) -> Iterator[Pair]:
    # One prefill engine per engine and module: engines are meant to be reused across requests,
    # and Mooncake's native destructor alone takes about 1 s. Tests that break or close an
    # engine build a Pair of their own.
    p = Pair(engine_name, source, decode)
    yield p
    p.close()


@pytest.fixture
def pair(_module_pair: Pair) -> Pair:
    """A prefill engine connected to the module's decode side, whose destination was just reset."""
    _module_pair.decode.reset()
    return _module_pair


def scattered(rng: np.random.Generator, count: int, max_len: int, slot: int) -> Descs:
    """``count`` descriptors with non-overlapping destinations: one per ``slot``-byte slot,
    spread over both destination regions, random sources in both source regions."""
    slots_per_region = [n // slot for n in DST_SIZES]
    chosen = rng.choice(sum(slots_per_region), size=count, replace=False)
    d_reg = (chosen >= slots_per_region[0]).astype(np.int64)
    slot_idx = chosen - d_reg * slots_per_region[0]
    length = rng.integers(1, max_len + 1, count)
    d_off = slot_idx * slot + rng.integers(0, slot - length + 1)
    s_reg = rng.integers(0, 2, count)
    s_off = rng.integers(0, np.array(SRC_SIZES)[s_reg] - length + 1)
    return Descs(s_reg, s_off, d_reg, d_off, length)


def test_endpoint_is_msgpack_data_and_connect_is_idempotent(pair: Pair) -> None:
    ep = pair.decode.endpoint
    assert msgpack.unpackb(msgpack.packb(ep), raw=False) == ep
    assert ep["engine"] == pair.name
    assert {"engine_id", "regions"} <= set(ep)
    assert [(r["base_ptr"], r["nbytes"]) for r in ep["regions"]] == sorted(
        (r.base_ptr, r.nbytes) for r in pair.decode.dst_regions
    )
    assert isinstance(pair.peer_id, str)
    assert pair.engine.connect(proven(pair.engine, ep)) == pair.peer_id


def test_reconnect_with_the_same_endpoint_keeps_the_connection(pair: Pair) -> None:
    """A decode that registers again sends the same endpoint: nothing is re-mapped or re-opened
    (for shm that was ~5 ms of a ~8 ms re-handshake); a changed endpoint rebuilds the peer."""
    ep = pair.decode.endpoint
    native = pair.engine._peers[pair.peer_id].native
    assert pair.engine.connect(proven(pair.engine, dict(ep))) == pair.peer_id
    assert pair.engine._peers[pair.peer_id].native is native
    d = Descs.of([(0, 0, 1, 64, 4096)])
    pair.transfer(d)
    pair.assert_destination(pair.expected(d))
    changed = {**ep, "regions": []}  # the same engine, publishing nothing now
    assert pair.engine.connect(proven(pair.engine, changed)) == pair.peer_id
    with pytest.raises(DescriptorOutOfRange):
        pair.transfer(Descs.of([(0, 0, 1, 64, 8)]))  # its regions were read again
    assert pair.engine.connect(proven(pair.engine, ep)) == pair.peer_id  # (restored for the other tests)


def test_scattered_descriptors_land_exact_bytes(pair: Pair) -> None:
    d = scattered(np.random.default_rng(1), count=48, max_len=20_000, slot=64 << 10)
    zero = Descs.of([(0, 5, 0, 7, 0)])  # zero-length: checked, moves nothing
    d = Descs(*(np.concatenate([a, b]) for a, b in zip(vars(d).values(), vars(zero).values())))
    pair.transfer(d)
    pair.assert_destination(pair.expected(d))


def test_descriptors_at_region_edges(pair: Pair) -> None:
    last = [n - 1 for n in DST_SIZES]
    d = Descs.of(
        [
            (0, 0, 0, 0, 1),  # first byte of region 0
            (1, SRC_SIZES[1] - 3, 0, last[0] - 2, 3),  # last bytes of region 0, from the end of src 1
            (0, 17, 1, 0, 4096),  # start of region 1
            (1, 0, 1, last[1], 1),  # last byte of region 1
        ]
    )
    pair.transfer(d)
    pair.assert_destination(pair.expected(d))


def test_empty_plan_completes_at_once(pair: Pair) -> None:
    handle = pair.engine.submit(pair.peer_id, TransferPlan.empty())
    assert pair.engine.poll(handle) is True
    pair.engine.wait(handle, 1.0)
    assert handle.status is TransferStatus.DONE
    pair.assert_destination(pair.untouched())


def test_large_contiguous_descriptor(pair: Pair) -> None:
    d = Descs.of([(0, 3, 0, 4096 + 123, 8 << 20)])
    pair.transfer(d)
    pair.assert_destination(pair.expected(d))


def test_more_descriptors_than_one_native_batch(pair: Pair) -> None:
    d = scattered(np.random.default_rng(2), count=5000, max_len=512, slot=2048)
    assert len(d.length) > 2 * 2048
    pair.transfer(d, timeout_s=20.0)
    pair.assert_destination(pair.expected(d))


def test_poll_and_wait_after_done_keep_answering(pair: Pair) -> None:
    d = Descs.of([(0, 0, 0, 0, 1000)])
    handle = pair.engine.submit(pair.peer_id, pair.plan(d))
    pair.engine.wait(handle, 15.0)
    assert pair.engine.poll(handle) is True
    pair.engine.wait(handle, 0.0)
    assert (handle.num_descriptors, handle.total_bytes) == (1, 1000)


def _bad_plan(pair: Pair, bad: tuple[int, int, int, int, int], index: int) -> Descs:
    rows = [(0, i * 100, 0, i * 4096, 100) for i in range(6)]
    rows[index] = bad
    return Descs.of(rows)


def _top(regions) -> int:
    """Index of the highest region: its end is outside every region (others may abut it)."""
    return max(range(len(regions)), key=lambda i: regions[i].base_ptr)


BAD_DESCRIPTORS = {
    # runs past the end of the highest dst region
    "dst-past-end": lambda p: (0, 0, _top(p.decode.dst_regions), DST_SIZES[_top(p.decode.dst_regions)] - 4, 8),
    # starts exactly at the end of the highest dst region
    "dst-at-end": lambda p: (0, 0, _top(p.decode.dst_regions), DST_SIZES[_top(p.decode.dst_regions)], 1),
    # runs past the end of the highest src region
    "src-past-end": lambda p: (_top(p.source.regions), SRC_SIZES[_top(p.source.regions)] - 4, 0, 0, 8),
}


@pytest.mark.parametrize("case", list(BAD_DESCRIPTORS))
def test_out_of_range_descriptor_raises_and_writes_nothing(pair: Pair, case: str) -> None:
    what = case[:3]
    d = _bad_plan(pair, BAD_DESCRIPTORS[case](pair), index=3)
    with pytest.raises(DescriptorOutOfRange, match=rf"^descriptor 3: {what} address 0x[0-9a-f]+ ") as info:
        pair.engine.submit(pair.peer_id, pair.plan(d))
    assert info.value.index == 3
    pair.assert_destination(pair.untouched())


@pytest.mark.parametrize("side", ["src", "dst"])
def test_address_in_no_region_raises(pair: Pair, side: str) -> None:
    good = pair.plan(Descs.of([(0, 0, 0, 0, 64)] * 2))
    arrays = {"src": good.src.copy(), "dst": good.dst.copy(), "length": good.length}
    arrays[side][1] = 4096  # the zero page: in nobody's registered region
    with pytest.raises(DescriptorOutOfRange, match=rf"^descriptor 1: {side} address 0x1000 \(\+64 bytes\)"):
        pair.engine.submit(pair.peer_id, TransferPlan.from_arrays(**arrays))
    pair.assert_destination(pair.untouched())


def test_huge_length_does_not_wrap_around(pair: Pair) -> None:
    plan = pair.plan(Descs.of([(0, 0, 0, 0, 1)]))
    plan = TransferPlan(plan.src, plan.dst, np.array([2**64 - 1], dtype=np.uint64), 0)
    with pytest.raises(DescriptorOutOfRange, match="^descriptor 0: src"):
        pair.engine.submit(pair.peer_id, plan)
    pair.assert_destination(pair.untouched())


def test_notifications_delivered_or_refused(pair: Pair) -> None:
    d = Descs.of([(0, 0, 1, 64, 256)])
    if not pair.engine.supports_notify:
        with pytest.raises(EngineError, match="cannot deliver completion notifications"):
            pair.engine.submit(pair.peer_id, pair.plan(d), notify=b"req-7")
        return
    pair.decode.notifications()  # drain earlier tests' messages
    pair.engine.wait(pair.engine.submit(pair.peer_id, pair.plan(d), notify=b"req-7"), 15.0)
    pair.engine.wait(pair.engine.submit(pair.peer_id, TransferPlan.empty(), notify=b"req-8"), 15.0)
    got: list[bytes] = []
    deadline = time.monotonic() + 10.0
    while len(got) < 2 and time.monotonic() < deadline:
        got += [msg for _sender, msg in pair.decode.notifications()]
    assert sorted(got) == [b"req-7", b"req-8"]
    pair.assert_destination(pair.expected(d))


def test_unknown_peer_and_foreign_endpoints(pair: Pair) -> None:
    plan = pair.plan(Descs.of([(0, 0, 0, 0, 8)]))
    with pytest.raises(UnknownPeer, match="no peer 'nope'"):
        pair.engine.submit("nope", plan)
    with pytest.raises(InvalidEndpoint, match="cannot connect to an endpoint of engine 'other'"):
        pair.engine.connect({**pair.decode.endpoint, "engine": "other"})
    truncated = {k: v for k, v in pair.decode.endpoint.items() if k != "regions"}
    with pytest.raises(InvalidEndpoint, match="missing regions"):
        pair.engine.connect(truncated)


def test_close_is_idempotent_and_final(engine_name: str, source, decode) -> None:
    pair = Pair(engine_name, source, decode)
    pair.engine.close()
    pair.engine.close()
    with pytest.raises(EngineStateError, match=r"submit\(\) called while closed"):
        pair.engine.submit(pair.peer_id, TransferPlan.empty())
    never_started = create_engine(engine_name, **ENGINE_OPTIONS[engine_name])
    never_started.close()
    never_started.close()
    with pytest.raises(EngineStateError, match=r"endpoint\(\) called while closed"):
        never_started.endpoint()


def test_context_manager_starts_and_closes(engine_name: str) -> None:
    with create_engine(engine_name, **ENGINE_OPTIONS[engine_name]) as engine:
        assert engine.endpoint()["engine"] == engine_name
    with pytest.raises(EngineStateError):
        engine.endpoint()


def test_peer_closed_before_connect_fails_not_hangs(engine_name: str, source, fresh_decode) -> None:
    endpoint = fresh_decode.endpoint
    fresh_decode.stop()
    engine = create_engine(engine_name, **ENGINE_OPTIONS[engine_name])
    engine.start()
    engine.register(source.regions)
    started = time.monotonic()
    try:
        with pytest.raises(EngineError):
            peer_id = engine.connect(proven(engine, endpoint))
            base = fresh_decode.dst_regions[0].base_ptr
            plan = TransferPlan.from_arrays([source.regions[0].base_ptr], [base], [4096])
            engine.wait(engine.submit(peer_id, plan), 10.0)
    finally:
        engine.close()
    within(f"{engine_name}: a closed peer's connect failing", time.monotonic() - started, 15.0, QUIET_FAIL_S)


def test_peer_killed_after_connect_fails_not_hangs(engine_name: str, source, fresh_decode) -> None:
    if not DETECTS_PEER_LOSS[engine_name]:
        pytest.skip(f"{engine_name} cannot observe a crashed peer (the control channel's heartbeat does)")
    pair = Pair(engine_name, source, fresh_decode)
    try:
        d = Descs.of([(0, 0, 0, 0, 4096)])
        pair.transfer(d)  # the connection is up and works
        fresh_decode.kill()
        started = time.monotonic()
        with pytest.raises(EngineError):
            pair.engine.wait(pair.engine.submit(pair.peer_id, pair.plan(d)), 10.0)
        within(f"{engine_name}: a killed peer's copy failing", time.monotonic() - started, 12.0, QUIET_FAIL_S)
    finally:
        pair.close()
