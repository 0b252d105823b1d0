"""Verification levels end to end, both agents in this process over the loopback engine: what each
level catches when the copy goes wrong (``sampled``: a one-page shift of the SWA window, a stale
C128 state, a damaged byte of a block of the sample; ``full``: one flipped byte anywhere; ``off``:
nothing, while the handshake still refuses), what ``sampled`` misses (a byte of a page outside the
sample), the level that ran in both sides' metrics, the refusal of a level below the prefill's and
of a sampled request by another sampling rule. (Over 200 seeds: ``tests/unit/test_sampled_catches.py``.)"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from pdstate.agent import DecodeAgent, PrefillAgent, RequestState
from pdstate.agent.verify import SAMPLE_RULE, block_offsets, sample_mask, sample_seed
from pdstate.errors import DigestMismatch, PageSizeMismatch, VerifyLevelRefused
from pdstate.protocol import wire
from tests.agent.support import make_side
from tests.support.hooked import hooked

ROOM = 41
SRC_PAGES, DST_PAGES = list(range(1, 13)), list(range(4, 16))  # 12 pages
# SWA (target), C128 state, SWA (draft): the SWA window is two rows, the C128 state one slot
SRC_STATE, DST_STATE = [[1, 2], [3], [1, 2]], [[2, 3], [7], [2, 3]]


def _item(ptr: int, item_len: int, index: int) -> ctypes.Array:
    return (ctypes.c_uint8 * item_len).from_address(ptr + index * item_len)


def _outside_sample() -> int:
    """A list position of the request's main-KV pages that ``sampled`` does not digest."""
    seed = sample_seed(ROOM, wire.PackedIndices.pack(DST_PAGES).data)
    skipped = np.flatnonzero(~sample_mask(seed, np.arange(len(DST_PAGES)), len(DST_PAGES)))
    assert skipped.size, "the request's sample holds every page: pick another room"
    return int(skipped[0])


def _inside_sample() -> int:
    seed = sample_seed(ROOM, wire.PackedIndices.pack(DST_PAGES).data)
    kept = np.flatnonzero(sample_mask(seed, np.arange(len(DST_PAGES)), len(DST_PAGES)))
    return int(kept[len(kept) // 2])


def swa_shift(p, d) -> None:
    """The decode's SWA window lands one page later than the prefill's (rows ``s+1`` for ``s``)."""
    for c, t in enumerate(d.state_types):
        if t.value == "swa":
            for sp, dp, n in zip(p.state_data_ptrs[c], d.state_data_ptrs[c], d.state_item_lens[c]):
                for s, t_ in zip(SRC_STATE[c], DST_STATE[c]):
                    _item(dp, n, t_)[:] = bytes(_item(sp, n, s + 1))


def c128_stale(before: dict):
    """The decode's C128 state slot keeps what it held before the request (a write that never landed)."""

    def fault(p, d) -> None:
        for (ptr, n), old in before.items():
            _item(ptr, n, 0)[:] = old

    return fault


def _in_block(d) -> int:
    """A byte offset, inside a main-KV page of the first buffer, that ``sampled`` reads."""
    seed = sample_seed(ROOM, wire.PackedIndices.pack(DST_PAGES).data)
    return int(block_offsets(seed, 0, d.kv_item_lens)[0, 1]) + 5


def flip(position: int, offset: int | None = None):
    """One flipped byte (at ``offset``, default 100) in the first main-KV buffer's page at
    ``position`` of the request."""

    def fault(p, d) -> None:
        _item(d.kv_data_ptrs[0], d.kv_item_lens[0], DST_PAGES[position])[100 if offset is None else offset] ^= 0x5A

    return fault


def run(sides, level: str, fault=None, prefill_level: str | None = None, send_pages: bool = True):
    """One request of 12 pages with its state and aux; ``fault(prefill_kv, decode_kv)`` runs right
    after the copy landed (before the decode digests). Returns both sides' states, errors, metrics."""
    p, d = sides
    with hooked("loopback") as hooks:
        if fault is not None:  # right after each plan the prefill's engine copied
            hooks.after_submit = lambda plan: fault(p.kv_args, d.kv_args)
        engine = {"engine": hooks.engine, "engine_options": hooks.options()}
        pa = PrefillAgent(p.kv_args, (p.pools.target, p.pools.draft), **engine, verify=prefill_level)
        return _request(
            pa, DecodeAgent(d.kv_args, (d.pools.target, d.pools.draft), engine="loopback", verify=level), send_pages
        )


def _request(pa: PrefillAgent, da: DecodeAgent, send_pages: bool):
    try:
        recv, send = da.receiver(pa.address, ROOM), pa.sender(ROOM, len(SRC_PAGES), aux_index=0)
        recv.init(DST_PAGES, DST_STATE, aux_index=1)
        if send_pages:
            send.send(SRC_PAGES, SRC_STATE)
        out = (recv.wait(10), send.wait(10))
        return out, (recv.failure_exception(), send.failure_exception()), (recv.metrics, send.metrics)
    finally:
        da.close()
        pa.close()


def _c128_before(d) -> dict:
    c = [t.value for t in d.state_types].index("c128_state")
    return {
        (ptr + DST_STATE[c][0] * n, n): bytes(_item(ptr, n, DST_STATE[c][0]))
        for ptr, n in zip(d.state_data_ptrs[c], d.state_item_lens[c])
    }


@pytest.mark.parametrize("level", ["sampled", "full", "off"])
def test_a_clean_copy_succeeds_and_both_sides_name_the_level(sides, level):
    states, errors, (rm, sm) = run(sides, level)
    assert states == (RequestState.SUCCESS, RequestState.SUCCESS), errors
    assert rm["verify"] == sm["verify"] == level
    assert ("digest_s" in rm) is (level != "off")


@pytest.mark.parametrize(
    ("name", "caught_by"),
    [
        ("swa_shift", {"sampled", "full"}),
        ("c128_stale", {"sampled", "full"}),
        ("flip_in_sample", {"sampled", "full"}),
        ("flip_outside_sample", {"full"}),  # sampled misses a byte of a page it does not digest
    ],
)
@pytest.mark.parametrize("level", ["sampled", "full", "off"])
def test_what_each_level_catches(sides, level, name, caught_by):
    faults = {
        "swa_shift": lambda: swa_shift,
        "c128_stale": lambda: c128_stale(_c128_before(sides[1].kv_args)),
        "flip_in_sample": lambda: flip(_inside_sample(), _in_block(sides[1].kv_args)),
        "flip_outside_sample": lambda: flip(_outside_sample()),
    }
    states, errors, (rm, sm) = run(sides, level, faults[name]())
    if level in caught_by:
        assert states == (RequestState.FAILED, RequestState.FAILED)
        assert type(errors[0]) is DigestMismatch and str(errors[1]) == str(errors[0])
        assert str(errors[0]).startswith(f"room {ROOM}: digest of the ")
    else:
        assert states == (RequestState.SUCCESS, RequestState.SUCCESS), errors
    assert rm["verify"] == level


def test_off_still_refuses_a_pair_the_handshake_refuses():
    p, d = make_side(False), make_side(False, page_size=128)
    try:
        pa = PrefillAgent(p.kv_args, (p.pools.target, p.pools.draft), engine="loopback")
        da = DecodeAgent(d.kv_args, (d.pools.target, d.pools.draft), engine="loopback", verify="off")
        try:
            recv = da.receiver(pa.address, ROOM)
            assert recv.wait(10) is RequestState.FAILED
            assert type(recv.failure_exception()) is PageSizeMismatch
        finally:
            da.close()
            pa.close()
    finally:
        p.close()
        d.close()


def test_a_level_below_the_prefills_fails_both_sides(sides):
    states, errors, _ = run(sides, "off", prefill_level="sampled", send_pages=False)  # refused on arrival
    assert states == (RequestState.FAILED, RequestState.FAILED)
    assert type(errors[0]) is VerifyLevelRefused and str(errors[0]) == str(errors[1])
    assert str(errors[0]) == (
        f"room {ROOM}: the decode asks verification 'off', below this prefill's transfer.verify 'sampled'"
    )
    assert run(sides, "full", prefill_level="sampled")[0] == (RequestState.SUCCESS, RequestState.SUCCESS)


def test_a_sampled_request_by_another_sampling_rule_fails_both_sides(sides, monkeypatch):
    """A decode sampling by another rule (rule 1: a pdstate from before rule 2, which named none;
    rule 2: one from before rule 3, which sampled 1 in 8 of each list; a later one) is refused before
    anything is copied, never left to fail as a digest mismatch."""
    import pdstate.agent.decode_core as decode_core

    assert SAMPLE_RULE == 3
    for named, rule in ((None, 1), (2, 2), (4, 4)):
        monkeypatch.setattr(decode_core, "SAMPLE_RULE", named)
        states, errors, _ = run(sides, "sampled", send_pages=False)
        assert states == (RequestState.FAILED, RequestState.FAILED)
        assert type(errors[0]) is VerifyLevelRefused and str(errors[0]) == str(errors[1])
        assert str(errors[0]) == (
            f"room {ROOM}: the decode samples by rule {rule}, this prefill by rule 3 (transfer.verify "
            "'sampled' of another pdstate release): run the same release on both sides, or "
            "transfer.verify 'full' on the decode"
        )
