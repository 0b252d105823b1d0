"""What ``sampled`` (sample rule 3) catches, over 200 seeds each, on the real ``dsv4-flash`` layout
(pdstate's pools: 62 main-KV buffers, 85 SWA buffers, 20 C128 buffers, the draft's SWA, two aux
buffers): the prefill's digest of what it sent against the decode's digest of what landed, driven
through the digest functions directly (the prefill's main KV in three chunks, then the state and
aux; the decode's whole request at once), after a copy with one fault in it:

- a one-page shift of the SWA window (every SWA row lands one row later than it should);
- a stale C128 state (the decode's C128 slot keeps what it held before);
- a missing last chunk (the last chunk's main-KV pages never land; its state and aux do);
- two layers' state swapped (two SWA buffers of one item length, a different pair per seed).

Each counts the seeds whose digests differ, asserts the exact count (every seed, 200 of 200; the
issue's bar is 199) and prints it; a clean copy agrees in every seed, so a count cannot come from
digests that always differ. One end-to-end case runs the agent pair over the loopback engine with
the last chunk missing.
"""

from __future__ import annotations

import ctypes
from contextlib import ExitStack

import numpy as np
import pytest

from pdstate.agent import DecodeAgent, PrefillAgent, RequestState
from pdstate.agent.common import channel_layout
from pdstate.agent.verify import (
    SAMPLE_BLOCK,
    SAMPLE_BLOCKS,
    SAMPLE_OTHERS,
    SampleDigest,
    block_offsets,
    new_digest,
    sample_seed,
)
from pdstate.errors import DigestMismatch
from pdstate.protocol import wire
from tests.agent.support import fill, make_side
from tests.support.hooked import hooked

SEEDS = 200
N_PAGES = 24  # main-KV pages of the request, sent in three chunks of 8
SRC_PAGES, DST_PAGES = list(range(1, 1 + N_PAGES)), list(range(30 - N_PAGES, 30))
# per state component (target SWA, C128, draft SWA): the window is three SWA rows
SRC_STATE, DST_STATE = [[0, 1, 2], [1], [0, 1, 2]], [[1, 2, 3], [2], [1, 2, 3]]
SRC_AUX, DST_AUX = 0, 3
CHUNKS = [(0, 8), (8, 16), (16, 24)]


@pytest.fixture(scope="module")
def flash():
    """A prefill side and a decode side of the ``dsv4-flash`` layout (small pools), filled with
    different seeded bytes."""
    changes = dict(full_tokens=8192, swa_tokens=1280, max_num_reqs=2, online_c128=True, online_c128_mtp=True)
    p, d = make_side(False, "dsv4-flash", **changes), make_side(False, "dsv4-flash", **changes)
    fill(p.kv_args, 1)
    fill(d.kv_args, 2)
    yield p.kv_args, d.kv_args
    p.close()
    d.close()


def _item(ptr: int, n: int, index: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr + index * n))


def _channels(kv) -> list[tuple[list[int], list[int]]]:
    return channel_layout(kv, kv.aux_data_ptrs, kv.aux_item_lens)


def _copy(p, d, skip: set[str] = frozenset()) -> None:
    """The request's bytes from the prefill's items to the decode's, but for ``skip`` (channel
    names: ``main_last_chunk``, ``c128``)."""
    pages = [(s, t) for s, t in zip(SRC_PAGES, DST_PAGES)]
    if "main_last_chunk" in skip:
        pages = pages[: CHUNKS[-1][0]]
    for sp, dp, n in zip(p.kv_data_ptrs, d.kv_data_ptrs, d.kv_item_lens):
        for s, t in pages:
            _item(dp, n, t)[:] = _item(sp, n, s)
    for c, kind in enumerate(d.state_types):
        if kind.value == "c128_state" and "c128" in skip:
            continue
        for sp, dp, n in zip(p.state_data_ptrs[c], d.state_data_ptrs[c], d.state_item_lens[c]):
            for s, t in zip(SRC_STATE[c], DST_STATE[c]):
                _item(dp, n, t)[:] = _item(sp, n, s)
    for sp, dp, n in zip(p.aux_data_ptrs, d.aux_data_ptrs, d.aux_item_lens):
        _item(dp, n, DST_AUX)[:] = _item(sp, n, SRC_AUX)


def _digests(p, d, room: int) -> tuple[bytes, bytes]:
    """The prefill's digest of what it sent (main KV chunk by chunk, then state and aux, in the
    background as over a native engine) and the decode's of what landed (all at once)."""
    packed = wire.PackedIndices.pack(DST_PAGES).data
    lengths = [N_PAGES, *(len(s) for s in DST_STATE), 1]
    mine = new_digest(_channels(p), "sampled", room=room, packed_pages=packed, lengths=lengths)
    theirs = new_digest(_channels(d), "sampled", room=room, packed_pages=packed, lengths=lengths)
    for lo, hi in CHUNKS:
        mine.update_async([(0, np.array(SRC_PAGES[lo:hi]))])
    n = len(SRC_STATE)
    mine.update_async([*((1 + c, np.array(s)) for c, s in enumerate(SRC_STATE)), (1 + n, np.array([SRC_AUX]))])
    updates = [(0, np.array(DST_PAGES)), *((1 + c, np.array(s)) for c, s in enumerate(DST_STATE))]
    theirs.update_many([*updates, (1 + n, np.array([DST_AUX]))])
    return mine.digest(), theirs.digest()


def _caught(p, d, rooms) -> int:
    return sum(a != b for a, b in (_digests(p, d, room) for room in rooms))


def _component(kv, kind: str) -> int:
    return [t.value for t in kv.state_types].index(kind)


def test_a_clean_copy_agrees_in_every_seed(flash):
    p, d = flash
    _copy(p, d)
    agreed = SEEDS - _caught(p, d, range(SEEDS))
    print(f"clean copy: digests agree in {agreed} of {SEEDS} seeds")
    assert agreed == SEEDS


def test_a_one_page_shift_of_the_swa_window(flash):
    p, d = flash
    _copy(p, d)
    c = _component(d, "swa")
    for sp, dp, n in zip(p.state_data_ptrs[c], d.state_data_ptrs[c], d.state_item_lens[c]):
        for s, t in zip(SRC_STATE[c], DST_STATE[c]):
            _item(dp, n, t)[:] = _item(sp, n, s + 1)  # each row lands the next row's bytes
    caught = _caught(p, d, range(SEEDS))
    print(f"SWA window shifted one page: caught in {caught} of {SEEDS} seeds")
    assert caught == SEEDS


def test_a_stale_c128_state(flash):
    p, d = flash
    c = _component(d, "c128_state")
    for dp, n in zip(d.state_data_ptrs[c], d.state_item_lens[c]):
        _item(dp, n, DST_STATE[c][0])[:] = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)  # before
    _copy(p, d, skip={"c128"})
    caught = _caught(p, d, range(SEEDS))
    print(f"stale C128 state: caught in {caught} of {SEEDS} seeds")
    assert caught == SEEDS


def test_a_missing_last_chunk(flash):
    p, d = flash
    for dp, n in zip(d.kv_data_ptrs, d.kv_item_lens):  # what the pages held before the request
        for t in DST_PAGES:
            _item(dp, n, t)[:] = np.random.default_rng([n, t]).integers(0, 256, n, dtype=np.uint8)
    _copy(p, d, skip={"main_last_chunk"})
    caught = _caught(p, d, range(SEEDS))
    print(f"last chunk missing: caught in {caught} of {SEEDS} seeds")
    assert caught == SEEDS


def test_two_layers_state_swapped(flash):
    p, d = flash
    _copy(p, d)
    c = _component(d, "swa")
    lens = np.asarray(d.state_item_lens[c])
    rng = np.random.default_rng(37)
    caught = 0
    for room in range(SEEDS):
        n = int(rng.choice(np.unique(lens)))
        i, j = (int(b) for b in rng.choice(np.flatnonzero(lens == n), 2, replace=False))
        a, b = d.state_data_ptrs[c][i], d.state_data_ptrs[c][j]
        for t in DST_STATE[c]:  # layers i and j of the request's rows trade places
            x, y = _item(a, n, t), _item(b, n, t)
            x[:], y[:] = y.copy(), x.copy()
        caught += _digests(p, d, room)[0] != _digests(p, d, room)[1]
        for t in DST_STATE[c]:
            x, y = _item(a, n, t), _item(b, n, t)
            x[:], y[:] = y.copy(), x.copy()
    print(f"two layers' SWA state swapped: caught in {caught} of {SEEDS} seeds")
    assert caught == SEEDS
    assert _caught(p, d, range(3)) == 0  # swapped back: the copy is clean again


def test_what_the_sample_reads_is_the_rule(flash):
    """The blocks a sampled digest reads are where ``block_offsets`` puts them: a byte in a block
    changes the digest, a byte beside every block does not."""
    p, d = flash
    _copy(p, d)
    room = 5
    seed = sample_seed(room, wire.PackedIndices.pack(DST_PAGES).data)
    c = _component(d, "swa")
    n = d.state_item_lens[c][0]
    offs = block_offsets(seed, 1 + c, d.state_item_lens[c])[0]
    assert offs.size == SAMPLE_BLOCKS and all(
        k * (n // SAMPLE_BLOCKS) <= o < (k + 1) * (n // SAMPLE_BLOCKS) for k, o in enumerate(offs)
    )
    row = _item(d.state_data_ptrs[c][0], n, DST_STATE[c][-1])  # the window's last row: always sampled
    inside, outside = int(offs[0]) + 7, int(offs[0]) + SAMPLE_BLOCK
    assert not any(o <= outside < o + SAMPLE_BLOCK for o in offs)
    for at, differs in ((outside, False), (inside, True)):
        row[at] ^= 0x01
        a, b = _digests(p, d, room)
        row[at] ^= 0x01
        assert (a != b) is differs, at


def test_the_sample_is_small_and_flat_in_length(flash):
    """The bytes a sampled digest reads: ``SAMPLE_BLOCKS`` blocks of ``SAMPLE_BLOCK`` bytes per
    buffer of each sampled item, and as many items (the first, the last, ``SAMPLE_OTHERS`` others)
    of a list of 24 pages as of one of 8, or of 12 read in three chunks."""
    p, _ = flash
    per_page = len(p.kv_data_ptrs) * SAMPLE_BLOCKS * SAMPLE_BLOCK
    read = {}
    for pages, step in ((8, 8), (12, 4), (N_PAGES, N_PAGES)):
        lengths = [pages, *(len(s) for s in SRC_STATE), 1]
        dig = SampleDigest(_channels(p), seed=11, lengths=lengths)
        for lo in range(0, pages, step):
            dig.update_many([(0, np.array(SRC_PAGES[lo : lo + step]))])
        read[pages] = dig.bytes
    assert read == {pages: (SAMPLE_OTHERS + 2) * per_page for pages in (8, 12, N_PAGES)}
    assert read[N_PAGES] < 0.01 * N_PAGES * sum(p.kv_item_lens)


def test_the_agent_pair_catches_a_missing_last_chunk():
    """End to end (both agents, loopback engine, ``tiny`` layout, ``sampled`` the default): the
    last of three chunks' pages never land (their destination keeps what it held; the chunk's
    state and aux do land); both sides fail with the decode's ``DigestMismatch``."""
    p, d = make_side(False), make_side(False)
    fill(p.kv_args, 1)
    fill(d.kv_args, 2)
    dst_pages = list(range(4, 16))
    kv = d.kv_args
    before = {
        (ptr, n, t): _item(ptr, n, t).copy() for ptr, n in zip(kv.kv_data_ptrs, kv.kv_item_lens) for t in dst_pages[8:]
    }
    stack = ExitStack()
    hooks = stack.enter_context(hooked("loopback"))
    pa = PrefillAgent(p.kv_args, (p.pools.target, p.pools.draft), engine=hooks.engine, engine_options=hooks.options())
    da = DecodeAgent(d.kv_args, (d.pools.target, d.pools.draft), engine="loopback")
    try:
        submits = []

        def last_pages_lost(plan):
            submits.append(len(plan))
            if len(submits) == 3:
                for (ptr, n, t), old in before.items():
                    _item(ptr, n, t)[:] = old

        hooks.after_submit = last_pages_lost
        recv, send = da.receiver(pa.address, 77), pa.sender(77, 12, aux_index=0)
        recv.init(dst_pages, [[2, 3], [7], [2, 3]], aux_index=1)
        send.send(list(range(1, 5)))
        send.send(list(range(5, 9)))
        send.send(list(range(9, 13)), [[1, 2], [3], [1, 2]])
        states = recv.wait(10), send.wait(10)
        assert len(submits) == 3  # one engine call a chunk: the last one's state not sent ahead
        assert states == (RequestState.FAILED, RequestState.FAILED)
        assert type(recv.failure_exception()) is DigestMismatch
        assert str(recv.failure_exception()).startswith("room 77: digest of the ")
        assert recv.metrics["verify"] == send.metrics["verify"] == "sampled"
    finally:
        da.close()
        pa.close()
        p.close()
        d.close()
        stack.close()


def test_the_sample_positions_are_one_rule():
    """``sample_positions`` is the rule (the first, the last, one seeded position in each of
    ``SAMPLE_OTHERS`` equal strata between them); ``sample_mask`` and the pick of a chunk
    (``verify._kept``) are read off it, so a list sampled whole or in chunks keeps the same
    positions; the pick moves with the seed."""
    from pdstate.agent.verify import _kept, sample_mask, sample_positions

    rng = np.random.default_rng(3)
    for _ in range(400):
        seed = int(rng.integers(0, 2**63)) ^ (int(rng.integers(0, 4)) << 56)
        n = int(rng.integers(1, 200))
        want = sample_positions(seed, n)
        inner = n - 2
        if n <= SAMPLE_OTHERS + 2:
            assert want == tuple(range(n))
        else:
            assert len(want) == SAMPLE_OTHERS + 2 and want[0] == 0 and want[-1] == n - 1
            for s, p in enumerate(want[1:-1]):  # one in each stratum
                assert 1 + inner * s // SAMPLE_OTHERS <= p < 1 + inner * (s + 1) // SAMPLE_OTHERS
        assert np.flatnonzero(sample_mask(seed, np.arange(n), n)).tolist() == list(want)
        cuts = sorted({0, n, *rng.integers(0, n, 3).tolist()})
        chunked = [lo + j for lo, hi in zip(cuts, cuts[1:]) for j in _kept(seed, lo, hi - lo, n)]
        assert chunked == list(want), (seed, n, cuts)
    assert len({sample_positions(seed, 150) for seed in range(200)}) > 100  # seeded, not one fixed pick


# The prefill's and the decode's digests of a clean copy (rooms 0-2), recorded from sample rule 3:
# a change that keeps the rule must keep these bytes (a new rule changes them, and SAMPLE_RULE).
GOLDEN = {
    0: "ae3fc8db588e4602322f3da64b1bb08c",
    1: "f859c637282d3f93d3341e1a21bfb841",
    2: "3d93a04d08bc24a23af20d3b13f41c80",
}


def test_sampled_digests_are_the_recorded_ones(flash):
    p, d = flash
    _copy(p, d)
    got = {room: _digests(p, d, room)[0].hex() for room in range(3)}
    assert all(_digests(p, d, room)[1].hex() == h for room, h in got.items())
    assert got == GOLDEN


def test_a_prepared_sample_reads_the_same_bytes(flash):
    """The decode picks its sample ahead (``prepare``); reading it then gives the digest of the
    same bytes as picking and reading at once, and a byte changed after the pick is read."""
    p, d = flash
    _copy(p, d)
    packed = wire.PackedIndices.pack(DST_PAGES).data
    lengths = [N_PAGES, *(len(s) for s in DST_STATE), 1]
    n = len(DST_STATE)
    updates = [(0, np.array(DST_PAGES)), *((1 + c, np.array(s)) for c, s in enumerate(DST_STATE))]
    updates.append((1 + n, np.array([DST_AUX])))
    for room in range(3):
        ahead = new_digest(_channels(d), "sampled", room=room, packed_pages=packed, lengths=lengths)
        ahead.prepare(updates)
        ahead.update_many(updates)
        assert ahead.digest().hex() == GOLDEN[room]
    row = _item(d.kv_data_ptrs[0], d.kv_item_lens[0], DST_PAGES[0])  # the first page: always sampled
    ahead = new_digest(_channels(d), "sampled", room=0, packed_pages=packed, lengths=lengths)
    ahead.prepare(updates)
    saved = row.copy()
    row[:] ^= 0xFF  # lands after the pick
    ahead.update_many(updates)
    row[:] = saved
    assert ahead.digest().hex() != GOLDEN[0]
