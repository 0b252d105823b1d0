"""The device form of a digest, run on CPU tensors through the same code a GPU runs: it gives the
host (numpy) path's value, for every item width, at ``sampled`` and ``full``; a changed word
changes it; and two agents whose decode digests "on its device" (here: CPU tensors) agree with a
prefill that digests on the host, and still catch a damaged page."""

from __future__ import annotations

from contextlib import ExitStack

import numpy as np
import pytest
import torch

from pdstate.agent import DecodeAgent, PrefillAgent, RequestState
from pdstate.agent.common import channel_layout
from pdstate.agent.verify import SAMPLE_BLOCKS, PositionDigest, SampleDigest, lane_values, lane_values_host
from pdstate.errors import DigestMismatch
from pdstate.pools.placement import memory_devices
from tests.agent.support import fill, make_side
from tests.support.hooked import hooked

# main KV: item lengths a multiple of 8, of 4 only, and odd (each word width of the lane value)
ITEMS = [(4096, 3), (100, 1), (37, 2)]


@pytest.fixture
def layout():
    rng = np.random.default_rng(7)
    bufs, lay = [], []
    for item, count in ITEMS:
        bs = [rng.integers(0, 256, 64 * item, dtype=np.uint8) for _ in range(count)]
        bufs += bs
        lay.append(([b.ctypes.data for b in bs], [item] * count))
    return bufs, lay


UPDATES = [(0, list(range(3, 20))), (0, list(range(20, 40))), (1, [5, 6, 60]), (2, [0, 63, 9])]


def digest(lay, level: str, form: str, torch_on_host: bool) -> bytes:
    if level == "sampled":
        d = SampleDigest(lay, seed=12345, lengths=[37, 3, 3], form=form, torch_on_host=torch_on_host)
    else:
        assert form == "device"  # ``full`` in host form is ``RequestDigest``
        d = PositionDigest(lay, seed=12345, n_pages=37, torch_on_host=torch_on_host)
    d.update(*UPDATES[0])
    d.update_async(UPDATES[1:2])
    for u in UPDATES[2:]:
        d.update(*u)
    return d.digest()


@pytest.mark.parametrize("level", ["sampled", "full"])
def test_the_device_path_on_cpu_tensors_gives_the_host_paths_value(layout, level):
    bufs, lay = layout
    on_device = digest(lay, level, "device", torch_on_host=True)
    assert on_device == digest(lay, level, "device", torch_on_host=False)
    if level == "sampled":
        assert on_device != digest(lay, level, "host", torch_on_host=False)  # the forms are distinct values
    bufs[0][25 * 4096 + 8] ^= 1  # one bit of a page every level digests (list position 22 of 37)
    changed = digest(lay, level, "device", torch_on_host=True)
    assert changed == digest(lay, level, "device", torch_on_host=False)
    if level == "full":
        assert changed != on_device


@pytest.mark.parametrize("item", [64, 100, 37])
def test_lane_values_agree_and_see_any_one_changed_word(item):
    rng = np.random.default_rng(item)
    items = rng.integers(0, 256, (16, item), dtype=np.uint8)
    host = lane_values_host(items)
    assert np.array_equal(lane_values(torch.from_numpy(items)), host)
    for pos in (0, item // 2, item - 1):
        bad = items.copy()
        bad[3, pos] ^= 0x80
        vals = lane_values_host(bad)
        assert vals[3] != host[3] and np.array_equal(np.delete(vals, 3), np.delete(host, 3))
        assert np.array_equal(lane_values(torch.from_numpy(bad)), vals)


def test_host_memory_is_host_memory_without_cuda():
    t = torch.zeros(64, dtype=torch.uint8)
    assert memory_devices([t.data_ptr(), 4096]) == [None, None]


@pytest.mark.parametrize("damage", [False, True])
def test_a_decode_digesting_on_its_device_agrees_with_a_host_prefill(damage):
    stack = ExitStack()
    p, d = make_side(False), make_side(False)
    fill(p.kv_args, 1)
    fill(d.kv_args, 2)
    hooks = stack.enter_context(hooked("loopback"))
    pa = PrefillAgent(p.kv_args, (p.pools.target, p.pools.draft), engine=hooks.engine, engine_options=hooks.options())
    layout = channel_layout(d.kv_args, d.kv_args.aux_data_ptrs, d.kv_args.aux_item_lens)
    devices = [["cpu"] * len(ptrs) for ptrs, _ in layout]  # the device path, on CPU tensors
    da = DecodeAgent(d.kv_args, (d.pools.target, d.pools.draft), engine="loopback", verify="full", devices=devices)
    try:
        if damage:

            def corrupting(plan):
                ptr, n = d.kv_args.kv_data_ptrs[1], d.kv_args.kv_item_lens[1]
                (np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(ptr + 6 * n)))[7] ^= 1

            hooks.after_submit = corrupting
        recv, send = da.receiver(pa.address, 9), pa.sender(9, 3)
        recv.init([5, 6, 7], [[1], [0], [1]])
        send.send([1, 2, 3], [[2], [1], [2]])
        states = recv.wait(10), send.wait(10)
        if damage:
            assert states == (RequestState.FAILED, RequestState.FAILED)
            assert type(recv.failure_exception()) is DigestMismatch
        else:
            assert states == (RequestState.SUCCESS, RequestState.SUCCESS), recv.failure_exception()
        assert recv.metrics["verify"] == send.metrics["verify"] == "full"
        assert send.metrics["digest_form"] == "device"  # asked by the decode, computed by numpy here
    finally:
        da.close()
        pa.close()
        p.close()
        d.close()
        stack.close()


def test_digests_hashed_beside_the_copy_refuse_to_be_fused_with_their_own_words(layout):
    """Neither a device-form ``full`` digest nor a ``sampled`` one can be hashed inside the copy;
    each says which it is, and neither is offered to the copy (``fusable``)."""
    _, lay = layout
    cases = [
        (PositionDigest(lay, seed=1, n_pages=37), "a device-form digest is hashed beside the copy, not in it"),
        (SampleDigest(lay, seed=1, lengths=[37, 3, 3]), "a sampled digest is hashed beside the copy, not in it"),
    ]
    for d, text in cases:
        assert d.fusable is False
        with pytest.raises(ValueError) as e:
            d.streams(np.zeros(1, np.uint64), np.zeros(1, np.uint64))
        assert str(e.value) == text
        with pytest.raises(ValueError) as e:
            d.fused_streams([(0, [1])])
        assert str(e.value) == text


def test_a_sampled_digest_reads_its_own_layouts_memory(layout):
    """The layout's table is made once per layout: a second layout of the same shape over other
    buffers (the same bytes) digests the same, reads its own memory (a byte changed there changes
    its digest, not the first's), and a layout given as arrays is the same layout."""
    bufs, lay = layout
    copies = [b.copy() for b in bufs]
    it = iter(copies)
    other = [([next(it).ctypes.data for _ in p], i) for p, i in lay]
    as_arrays = [(np.array(p, dtype=np.uint64), np.array(i)) for p, i in lay]

    def of(lay_) -> bytes:
        d = SampleDigest(lay_, seed=99, lengths=[64, 64, 64])
        d.update_many([(0, list(range(64))), (1, list(range(64))), (2, list(range(64)))])
        return d.digest()

    first = of(lay)
    assert of(other) == first and of(as_arrays) == first
    copies[0][: 4096 // SAMPLE_BLOCKS] ^= 0xFF  # item 0 of main KV's first buffer (always sampled): its first stratum
    assert of(other) != first
    assert of(lay) == first


def test_devices_of_another_layout_are_refused():
    d = make_side(False)
    try:
        layout = channel_layout(d.kv_args, d.kv_args.aux_data_ptrs, d.kv_args.aux_item_lens)
        mine = [len(ptrs) for ptrs, _ in layout]
        with pytest.raises(ValueError) as info:
            DecodeAgent(d.kv_args, (d.pools.target, d.pools.draft), engine="loopback", devices=[["cpu"]])
        assert str(info.value) == f"devices names [1] buffers per channel; this decode's digests read {mine}"
        assert len(mine) > 1
    finally:
        d.close()
