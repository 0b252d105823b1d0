"""Descriptor planning: run merging, per-request checks with exact messages, and property tests
against a naive one-descriptor-per-index reference. Fake descriptors only: no memory is touched."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdstate.errors import IndexCountMismatch, IndexOutOfRange, ItemLengthMismatch, PaddingPageIndex
from pdstate.transfer import planner
from pdstate.transfer.plan import TransferPlan
from pdstate.transfer.planner import Channel, plan_channel, plan_request, plan_request_loop, runs


@dataclass
class FakeDesc:
    """The ``KVArgs`` attribute names the planner reads."""

    kv_data_ptrs: list[int]
    kv_data_lens: list[int]
    kv_item_lens: list[int]
    state_types: list[str] = field(default_factory=list)
    state_data_ptrs: list[list[int]] = field(default_factory=list)
    state_data_lens: list[list[int]] = field(default_factory=list)
    state_item_lens: list[list[int]] = field(default_factory=list)


def desc(base: int, channels: list[tuple[str, list[int], list[int]]]) -> FakeDesc:
    """``channels[0]`` is main KV; each entry is ``(type, item_lens, lens)``; buffers back to back from ``base``."""
    addr = base
    ptrs_all = []
    for _, _items, lens in channels:
        ptrs = []
        for n in lens:
            ptrs.append(addr)
            addr += n + 4096
        ptrs_all.append(ptrs)
    (_, items0, lens0), rest = channels[0], channels[1:]
    return FakeDesc(
        kv_data_ptrs=ptrs_all[0],
        kv_data_lens=list(lens0),
        kv_item_lens=list(items0),
        state_types=[t for t, _, _ in rest],
        state_data_ptrs=ptrs_all[1:],
        state_data_lens=[list(n) for _, _, n in rest],
        state_item_lens=[list(i) for _, i, _ in rest],
    )


# main KV: 2 buffers of 10 items; swa: 1 buffer of 8 items; c128_state: 1 buffer of 4; swa_ring: 1 of 16
LAYOUT = [
    ("main_kv", [100, 10], [1000, 100]),
    ("swa", [64], [512]),
    ("c128_state", [32], [128]),
    ("swa_ring", [8], [128]),
]
SRC = desc(0x10_0000, LAYOUT)
DST = desc(0x90_0000, LAYOUT)
GOOD = [[1, 2, 3], [1, 2], [0], [0, 1]]


def plan(src_lists, dst_lists, src=SRC, dst=DST) -> TransferPlan:
    return plan_request(src, dst, src_lists, dst_lists)


def refused(cls, message, src_lists, dst_lists, src=SRC, dst=DST):
    with pytest.raises(cls) as info:
        plan(src_lists, dst_lists, src, dst)
    assert type(info.value) is cls
    assert str(info.value) == message


# --- runs -------------------------------------------------------------------------------------


def _runs(s, d):
    a, b, n = runs(np.asarray(s, dtype=np.int64), np.asarray(d, dtype=np.int64))
    return a.tolist(), b.tolist(), n.tolist()


@pytest.mark.parametrize(
    "s,d,expected",
    [
        ([], [], ([], [], [])),
        ([5], [9], ([5], [9], [1])),
        ([1, 2, 3], [7, 8, 9], ([1], [7], [3])),
        ([1, 2, 4, 5], [1, 2, 3, 4], ([1, 4], [1, 3], [2, 2])),  # src breaks
        ([1, 2, 3, 4], [1, 2, 4, 5], ([1, 3], [1, 4], [2, 2])),  # dst breaks
        ([3, 2, 1], [1, 2, 3], ([3, 2, 1], [1, 2, 3], [1, 1, 1])),  # descending never merges
        ([1, 2, 3], [3, 2, 1], ([1, 2, 3], [3, 2, 1], [1, 1, 1])),
        ([10, 11, 0, 1, 2], [20, 21, 22, 23, 24], ([10, 0], [20, 22], [2, 3])),  # ring wrap on src
    ],
)
def test_runs(s, d, expected):
    assert _runs(s, d) == expected


# --- plan_channel ---------------------------------------------------------------------------------


def chan(name, ptrs, lens, items):
    u = lambda xs: np.asarray(xs, dtype=np.uint64)  # noqa: E731
    return Channel(name, u(ptrs), u(lens), u(items))


def test_plan_channel_is_buffer_major():
    src = chan("swa", [1000, 5000], [800, 400], [100, 50])
    dst = chan("swa", [20000, 30000], [800, 400], [100, 50])
    s, d, n = plan_channel("c", src, dst, np.array([1, 2, 5]), np.array([3, 4, 6]))
    assert s.tolist() == [1100, 1500, 5050, 5250]
    assert d.tolist() == [20300, 20600, 30150, 30300]
    assert n.tolist() == [200, 100, 100, 50]
    assert s.dtype == d.dtype == n.dtype == np.uint64


def test_plan_channel_without_indices_or_buffers_is_empty():
    c = chan("c128_state", [1000], [800], [100])
    assert [x.size for x in plan_channel("c", c, c, np.array([], dtype=np.int64), np.array([], dtype=np.int64))] == [
        0,
        0,
        0,
    ]
    empty = chan("swa", [], [], [])
    assert [x.size for x in plan_channel("c", empty, empty, np.array([1]), np.array([2]))] == [0, 0, 0]


# --- plan_request: the good case ---------------------------------------------------------------


def test_plan_request_addresses_and_total():
    p = plan(GOOD, [[4, 5, 6], [7, 6], [3], [15, 0]])
    rows = list(zip(p.src.tolist(), p.dst.tolist(), p.length.tolist()))
    s, d = SRC, DST
    assert rows == [
        (s.kv_data_ptrs[0] + 100, d.kv_data_ptrs[0] + 400, 300),  # main KV buffer 0, one run of 3
        (s.kv_data_ptrs[1] + 10, d.kv_data_ptrs[1] + 40, 30),  # main KV buffer 1
        (s.state_data_ptrs[0][0] + 64, d.state_data_ptrs[0][0] + 7 * 64, 64),  # swa: 1->7, 2->6
        (s.state_data_ptrs[0][0] + 128, d.state_data_ptrs[0][0] + 6 * 64, 64),
        (s.state_data_ptrs[1][0], d.state_data_ptrs[1][0] + 3 * 32, 32),  # c128 state slot 0 is fine
        (s.state_data_ptrs[2][0], d.state_data_ptrs[2][0] + 15 * 8, 8),  # ring rows
        (s.state_data_ptrs[2][0] + 8, d.state_data_ptrs[2][0], 8),
    ]
    assert p.total_bytes == 300 + 30 + 64 + 64 + 32 + 8 + 8
    assert len(p) == p.num_descriptors == 7


def test_plan_request_accepts_empty_lists():
    p = plan([[], [], [], []], [[], [], [], []])
    assert len(p) == 0 and p.total_bytes == 0


def test_plan_chunks():
    p = plan(GOOD, [[4, 5, 6], [7, 6], [3], [15, 0]])
    chunks = list(p.chunks(3))
    assert [len(c) for c in chunks] == [3, 3, 1]
    assert sum(c.total_bytes for c in chunks) == p.total_bytes
    assert np.concatenate([c.src for c in chunks]).tolist() == p.src.tolist()


# --- plan_request: refusals, exact messages ---------------------------------------------------


@pytest.mark.parametrize(
    "c,label",
    [(0, "main KV"), (1, "component 0 (swa)"), (2, "component 1 (c128_state)"), (3, "component 2 (swa_ring)")],
)
def test_index_count_mismatch_is_strict_for_every_channel(c, label):
    dst = [list(x) for x in GOOD]
    dst[c] = dst[c][:-1]
    n = len(GOOD[c])
    refused(IndexCountMismatch, f"{label}: index count mismatch: prefill={n}, decode={n - 1}", GOOD, dst)
    refused(IndexCountMismatch, f"{label}: index count mismatch: prefill={n - 1}, decode={n}", dst, GOOD)


def test_index_list_count_mismatch():
    refused(IndexCountMismatch, "index lists: prefill sent 3, decode sent 4, layout has 4 channels", GOOD[:3], GOOD)
    refused(
        IndexCountMismatch,
        "index lists: prefill sent 4, decode sent 4, layout has 3 channels",
        GOOD,
        GOOD,
        desc(0x1000, LAYOUT[:3]),
        desc(0x900000, LAYOUT[:3]),
    )


def test_index_at_the_end_of_the_buffer_is_fine_one_past_is_refused():
    # main KV buffer 0: 1000 bytes of 100-byte items -> indices 0..9 (index*100+100 <= 1000)
    plan([[9], [1], [0], [0]], [[9], [1], [0], [0]])
    refused(
        IndexOutOfRange,
        "main KV: prefill index 10 is past buffer 0 (1000 bytes = 10 items of 100 bytes)",
        [[10], [1], [0], [0]],
        [[9], [1], [0], [0]],
    )
    refused(
        IndexOutOfRange,
        "main KV: decode index 10 is past buffer 0 (1000 bytes = 10 items of 100 bytes)",
        [[9], [1], [0], [0]],
        [[10], [1], [0], [0]],
    )


def test_a_partial_last_item_is_past_the_buffer():
    # 1050 bytes hold 10 whole 100-byte items; index 10 would need bytes [1000, 1100)
    layout = [("main_kv", [100], [1050])]
    src, dst = desc(0x1000, layout), desc(0x90000, layout)
    plan_request(src, dst, [[9]], [[9]])
    refused(
        IndexOutOfRange,
        "main KV: prefill index 10 is past buffer 0 (1050 bytes = 10 items of 100 bytes)",
        [[10]],
        [[9]],
        src,
        dst,
    )


def test_the_tightest_buffer_of_a_channel_bounds_it():
    layout = [("main_kv", [100, 10], [1000, 50])]  # buffer 1 only holds 5 items
    src, dst = desc(0x1000, layout), desc(0x90000, layout)
    refused(
        IndexOutOfRange,
        "main KV: decode index 5 is past buffer 1 (50 bytes = 5 items of 10 bytes)",
        [[1]],
        [[5]],
        src,
        dst,
    )


def test_ascending_lists_on_the_numpy_path_are_checked_by_their_ends():
    # the numpy path checks a strictly ascending list by its first and last index (no sort);
    # one that is not strictly ascending goes through min, max and the distinct count
    layout = [("main_kv", [10], [100 * 10])]  # 100 items
    src, dst = desc(0x1000, layout), desc(0x90000, layout)
    with _Path(-1):
        p = plan_request(src, dst, [list(range(1, 100))], [list(range(1, 100))])
        assert _rows(p) == [(0x1000 + 10, 0x90000 + 10, 99 * 10)]
        refused(
            IndexOutOfRange,
            "main KV: prefill index 100 is past buffer 0 (1000 bytes = 100 items of 10 bytes)",
            [list(range(2, 101))],
            [list(range(1, 100))],
            src,
            dst,
        )
        refused(IndexOutOfRange, "main KV: decode indices contain duplicates", [[1, 2, 3]], [[1, 2, 2]], src, dst)
        refused(PaddingPageIndex, "main KV: decode index 0 is the reserved padding page", [[1, 2]], [[0, 1]], src, dst)
        refused(IndexOutOfRange, "main KV: prefill index -1 is negative", [[3, -1]], [[1, 2]], src, dst)


@pytest.mark.parametrize(
    "c,label", [(1, "component 0 (swa)"), (2, "component 1 (c128_state)"), (3, "component 2 (swa_ring)")]
)
def test_past_buffer_in_state_components(c, label):
    caps = {1: (8, 64, 512), 2: (4, 32, 128), 3: (16, 8, 128)}
    cap, item, size = caps[c]
    src = [list(x) for x in GOOD]
    src[c] = [cap] + src[c][1:]
    refused(
        IndexOutOfRange,
        f"{label}: prefill index {cap} is past buffer 0 ({size} bytes = {cap} items of {item} bytes)",
        src,
        GOOD,
    )


@pytest.mark.parametrize("c,label", [(0, "main KV"), (2, "component 1 (c128_state)"), (3, "component 2 (swa_ring)")])
def test_negative_index_refused(c, label):
    dst = [list(x) for x in GOOD]
    dst[c] = [-1] + dst[c][1:]
    refused(IndexOutOfRange, f"{label}: decode index -1 is negative", GOOD, dst)


@pytest.mark.parametrize("c,label", [(0, "main KV"), (1, "component 0 (swa)"), (3, "component 2 (swa_ring)")])
def test_duplicate_indices_refused(c, label):
    src = [list(x) for x in GOOD]
    src[c] = [src[c][0]] * len(src[c])
    refused(IndexOutOfRange, f"{label}: prefill indices contain duplicates", src, GOOD)


@pytest.mark.parametrize("side", ["prefill", "decode"])
@pytest.mark.parametrize("c,label", [(0, "main KV"), (1, "component 0 (swa)")])
def test_padding_page_refused_on_page_addressed_channels(side, c, label):
    bad = [list(x) for x in GOOD]
    bad[c] = [0] + bad[c][1:]
    src, dst = (bad, GOOD) if side == "prefill" else (GOOD, bad)
    refused(PaddingPageIndex, f"{label}: {side} index 0 is the reserved padding page", src, dst)


def test_index_zero_is_fine_for_slot_and_row_channels():
    assert planner.PAGE_ADDRESSED == {"main_kv", "swa"}
    plan(GOOD, [[1, 2, 3], [1, 2], [0], [1, 0]])


def test_checks_run_in_order():
    # negative before padding before past-the-end before duplicates; prefill before decode
    refused(
        IndexOutOfRange,
        "main KV: prefill index -1 is negative",
        [[-1, 0, 99], [1, 2], [0], [0, 1]],
        [[0, 0, 0], [1, 2], [0], [0, 1]],
    )
    refused(
        PaddingPageIndex,
        "main KV: prefill index 0 is the reserved padding page",
        [[0, 99, 99], [1, 2], [0], [0, 1]],
        GOOD,
    )
    refused(IndexCountMismatch, "main KV: index count mismatch: prefill=1, decode=3", [[-1]] + GOOD[1:], GOOD)


def test_item_length_mismatch():
    other = desc(0x90_0000, [("main_kv", [100, 11], [1000, 110])] + LAYOUT[1:])
    refused(ItemLengthMismatch, "main KV: buffer 1 item length differs: prefill=10, decode=11", GOOD, GOOD, SRC, other)
    other = desc(0x90_0000, LAYOUT[:1] + [("swa", [64, 64], [512, 512])] + LAYOUT[2:])
    refused(ItemLengthMismatch, "component 0 (swa): prefill has 1 buffers, decode has 2", GOOD, GOOD, SRC, other)
    other = desc(0x90_0000, LAYOUT[:3] + [("swa", [8], [128])])
    refused(
        ItemLengthMismatch,
        "channels differ: prefill=['main_kv', 'swa', 'c128_state', 'swa_ring'], decode=['main_kv', 'swa', 'c128_state', 'swa']",
        GOOD,
        GOOD,
        SRC,
        other,
    )


def test_item_lengths_are_checked_before_counts():
    other = desc(0x90_0000, [("main_kv", [100, 11], [1000, 110])] + LAYOUT[1:])
    refused(
        ItemLengthMismatch,
        "main KV: buffer 1 item length differs: prefill=10, decode=11",
        [[1]] + GOOD[1:],
        GOOD,
        SRC,
        other,
    )


def test_nothing_is_planned_when_a_later_channel_is_refused():
    # the refusal comes from the last channel: no partial plan escapes
    with pytest.raises(IndexOutOfRange):
        plan(GOOD[:3] + [[0, 99]], GOOD)


# --- property tests against a naive reference ----------------------------------------------------


def reference(src_desc, dst_desc, src_lists, dst_lists) -> list[tuple[int, int, int]]:
    """One descriptor per index per buffer, channel by channel."""
    out = []
    for sc, dc, si, di in zip(planner.channels_of(src_desc), planner.channels_of(dst_desc), src_lists, dst_lists):
        for sp, dp, item in zip(sc.ptrs.tolist(), dc.ptrs.tolist(), sc.items.tolist()):
            for s, d in zip(si, di):
                out.append((sp + s * item, dp + d * item, item))
    return out


def byte_ranges(rows) -> list[tuple[int, int, int]]:
    """Normalise descriptors to maximal ``(src, dst, len)`` ranges so equal byte maps compare equal."""
    rows = sorted((int(s), int(d), int(n)) for s, d, n in rows if int(n))
    out: list[list[int]] = []
    for s, d, n in rows:
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += n
        else:
            out.append([s, d, n])
    return [tuple(r) for r in out]


def byte_map(rows) -> dict[int, int]:
    m = {}
    for s, d, n in rows:
        for k in range(int(n)):
            assert int(s) + k not in m, "a source byte is sent twice"
            m[int(s) + k] = int(d) + k
    return m


CHANNEL_TYPES = ["swa", "swa_ring", "c128_state"]


@st.composite
def requests(draw, contiguous: bool = False):
    """A random layout (both sides), and paired index lists that pass every check."""
    n_state = draw(st.integers(0, 3))
    names = ["main_kv"] + [draw(st.sampled_from(CHANNEL_TYPES)) for _ in range(n_state)]
    layout, src_lists, dst_lists = [], [], []
    for name in names:
        n_buf = draw(st.integers(1, 3))
        items = [draw(st.integers(1, 8)) for _ in range(n_buf)]
        cap = draw(st.integers(2, 24))
        layout.append((name, items, [cap * it + draw(st.integers(0, 3)) for it in items]))
        lo = 1 if name in planner.PAGE_ADDRESSED else 0
        count = draw(st.integers(0, cap - lo))
        if contiguous:
            s0 = draw(st.integers(lo, cap - count))
            d0 = draw(st.integers(lo, cap - count))
            si, di = list(range(s0, s0 + count)), list(range(d0, d0 + count))
        else:
            si = draw(st.permutations(range(lo, cap)))[:count]
            if draw(st.booleans()):  # mostly runs, as real allocators hand out
                si = sorted(si)
            di = sorted(draw(st.permutations(range(lo, cap)))[:count])
            if draw(st.booleans()):
                di = draw(st.permutations(di))
        src_lists.append(si)
        dst_lists.append(di)
    src = desc(0x1000, layout)
    dst = desc(0x100_0000, layout)
    return src, dst, src_lists, dst_lists


_PROPS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _rows(p: TransferPlan):
    return list(zip(p.src.tolist(), p.dst.tolist(), p.length.tolist()))


PATHS = pytest.mark.parametrize("small_list", [planner.SMALL_LIST, -1], ids=["python", "numpy"])


class _Path:
    """Plan through the plain-Python small-request path (the default limit) or force numpy."""

    def __init__(self, small_list: int) -> None:
        self.small_list = small_list

    def __enter__(self):
        self.saved, planner.SMALL_LIST = planner.SMALL_LIST, self.small_list

    def __exit__(self, *exc):
        planner.SMALL_LIST = self.saved


def _planned(small_list, req):
    """``plan_request`` of ``req`` on the path ``small_list`` picks; and ``req``."""
    src, dst, si, di = req
    with _Path(small_list):
        return plan_request(src, dst, si, di), req


@PATHS
@_PROPS
@given(req=requests())
def test_plan_covers_exactly_the_reference_bytes(small_list, req):
    p, (src, dst, si, di) = _planned(small_list, req)
    ref = reference(src, dst, si, di)
    assert byte_ranges(_rows(p)) == byte_ranges(ref)
    assert byte_map(_rows(p)) == byte_map(ref)
    assert p.total_bytes == sum(n for _, _, n in ref)
    assert len(p) <= len(ref)


@PATHS
@_PROPS
@given(req=requests(contiguous=True))
def test_a_contiguous_list_gives_one_descriptor_per_buffer(small_list, req):
    p, (src, dst, si, di) = _planned(small_list, req)
    expected = sum(c.items.size for c, lst in zip(planner.channels_of(src), si) if len(lst))
    assert len(p) == expected
    assert byte_ranges(_rows(p)) == byte_ranges(reference(src, dst, si, di))


@PATHS
@_PROPS
@given(req=requests())
def test_the_loop_baseline_gives_the_same_descriptors_in_the_same_order(small_list, req):
    src, dst, si, di = req
    with _Path(small_list):
        assert plan_request_loop(src, dst, si, di) == _rows(plan_request(src, dst, si, di))


def _outcome(fn):
    try:
        return _rows(fn())
    except Exception as exc:  # the same class and text on both paths
        return (type(exc).__name__, str(exc))


@_PROPS
@given(req=requests(), data=st.data())
def test_python_and_numpy_paths_agree_on_plans_and_refusals(req, data):
    src, dst, si, di = req
    si, di = [list(x) for x in si], [list(x) for x in di]
    c = data.draw(st.integers(0, len(si) - 1))
    damage = data.draw(st.sampled_from(["none", "negative", "past_end", "duplicate", "zero", "count"]))
    if damage != "none" and si[c]:
        k = data.draw(st.integers(0, len(si[c]) - 1))
        side = data.draw(st.sampled_from([si, di]))
        if damage == "negative":
            side[c][k] = -1
        elif damage == "past_end":
            side[c][k] = 10_000
        elif damage == "duplicate":
            side[c].append(side[c][k])
            (di if side is si else si)[c].append(10_001)
        elif damage == "zero":
            side[c][k] = 0
        else:
            side[c].pop(k)
    with _Path(planner.SMALL_LIST):
        small = _outcome(lambda: plan_request(src, dst, si, di))
    with _Path(-1):
        big = _outcome(lambda: plan_request(src, dst, si, di))
    assert small == big
