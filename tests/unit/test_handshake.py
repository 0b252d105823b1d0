"""Sans-IO handshake between two in-memory endpoints (frames go through ``wire``), and the request
lifecycle table."""

from __future__ import annotations

import functools
import itertools

import pytest

from pdstate import errors as e
from pdstate.errors import error_from_wire
from pdstate.pools.presets import PoolSettings
from pdstate.pools.reporting import build_report
from pdstate.protocol import handshake as h
from pdstate.protocol import lifecycle, wire
from tests.support.pools import TINY, TINY_DRAFT_FACTOR, kept_pools
from tests.support.upstream import MAPPING_ERROR, MISSING_MAPPING_ERROR, UNIFIED_ERROR

TOKEN = b"handshake-test-token"
SHM = wire.EngineDesc(name="shm", endpoint={"segment": "pdstate-test"})


@functools.cache
def side(settings: PoolSettings, worker_id: str) -> h.LocalSide:
    pools = kept_pools(settings)
    report, kv_args = build_report(pools.target, pools.draft)
    kv = None if kv_args is None else wire.KVDesc.of(kv_args)
    return h.LocalSide(worker_id=worker_id, incarnation=f"{worker_id}-inc", report=report, kv=kv, engine=SHM)


def prefill(**changes) -> h.LocalSide:
    return side(TINY.with_(**changes), "prefill-0")


def decode(**changes) -> h.LocalSide:
    return side(TINY.with_(**changes), "decode-0")


def exchange(p: h.LocalSide, d: h.LocalSide, token: bytes | None = TOKEN):
    """Decode registers; prefill answers; returns ``(reply, decode_result_or_exception)``."""
    register = wire.decode(wire.encode(h.DecodeHandshake(d).register_message(), token), token)
    reply = h.PrefillHandshake(p).receive(register)
    reply = wire.decode(wire.encode(reply, token), token)
    try:
        result = h.DecodeHandshake(d).receive(reply)
    except Exception as exc:
        result = exc
    return reply, result


def assert_refused(p, d, cls, message):
    reply, raised = exchange(p, d)
    assert isinstance(reply, wire.Reject), reply
    assert (reply.error.type, reply.error.message) == (cls.__name__, message)
    assert reply.worker_id == p.worker_id
    assert type(raised) is cls
    assert str(raised) == message
    # the class the decode raises is the one errors.error_from_wire rebuilds
    rebuilt = error_from_wire(reply.error.type, reply.error.message)
    assert type(rebuilt) is type(raised) and str(rebuilt) == str(raised)
    return reply


# --- accept ---------------------------------------------------------------------------------


def test_matching_pair_is_accepted():
    p, d = prefill(), decode()
    reply, result = exchange(p, d)
    assert isinstance(reply, wire.Accept)
    assert result == reply
    assert (reply.worker_id, reply.incarnation) == ("prefill-0", "prefill-0-inc")
    assert reply.report.fingerprint == p.report.fingerprint == d.report.fingerprint
    assert (reply.heartbeat_interval_s, reply.peer_timeout_s) == (1.0, 5.0)


def test_accepted_with_legitimately_different_sizes():
    reply, result = exchange(prefill(full_tokens=2048, max_num_reqs=8), decode())
    assert isinstance(reply, wire.Accept) and result == reply


def test_register_message_carries_the_decode_side():
    d = decode()
    reg = h.DecodeHandshake(d).register_message()
    assert (reg.worker_id, reg.incarnation, reg.role) == ("decode-0", "decode-0-inc", "decode")
    assert reg.report == d.report and reg.kv == d.kv and reg.engine == SHM


# --- reject: the decode raises what the prefill raised ---------------------------------------


@pytest.mark.parametrize("how", ["own", "clone", "view"])
def test_decode_with_unshared_draft_mapping_is_refused(how):
    reply = assert_refused(prefill(), decode(draft_mapping=how), e.SWAIndexMappingNotShared, MAPPING_ERROR)
    assert reply.error.message == decode(draft_mapping=how).report.local_check.error.message


def test_decode_with_a_draft_that_has_no_mapping_is_refused():
    # each release's own refusal: 0.5.19's pool has no mapping attribute, 0.5.23's holds None
    assert_refused(
        prefill(upstream="0.5.19"),
        decode(draft_mapping="none", upstream="0.5.19"),
        e.DraftMappingMissing,
        MISSING_MAPPING_ERROR,
    )
    assert_refused(prefill(), decode(draft_mapping="none"), e.SWAIndexMappingNotShared, MAPPING_ERROR)


@pytest.mark.parametrize(
    "changes,cls,message",
    [
        (
            dict(draft_unified_kv=True),
            e.UnifiedKVModeMismatch,
            UNIFIED_ERROR,
        ),
        (
            dict(draft_page_size=512, upstream="0.5.19"),
            e.PagedSWAGeometryMismatch,
            "DSV4 target and draft pools must share paged SWA geometry: target=(256, 128), draft=(512, 128)",
        ),
        (
            dict(draft_page_size=512),
            e.SWAGeometryMismatch,
            "DSV4 target and draft pools must share SWA geometry: target=(256, 128, None), draft=(512, 128, None)",
        ),
    ],
)
def test_decode_with_a_broken_pair_is_refused(changes, cls, message):
    assert_refused(prefill(), decode(**changes), cls, message)


def test_unified_decode_with_ring_geometry_mismatch_is_refused():
    assert_refused(
        prefill(unified_kv=True),
        decode(unified_kv=True, draft_sliding_window=64),
        e.SWARingGeometryMismatch,
        "DSV4 target and draft pools must share SWA ring geometry: target=(128, 131, 655), draft=(64, 67, 335)",
    )


def _layout(factor, p, d):
    return (
        f"DSV4 layout mismatch on {factor}: prefill server has {factor}={p!r}, but decode server has "
        f"{factor}={d!r}. Both servers must build the same state layout."
    )


CROSS_SIDE = [
    (
        dict(page_size=128, swa_page_size=128),
        e.PageSizeMismatch,
        "Page size mismatch: prefill server has page_size=256, but decode server has page_size=128. "
        "Both servers must use the same --page-size value.",
    ),
    (
        dict(kv_dtype="float8_e5m2"),
        e.KVCacheDtypeMismatch,
        "KV cache dtype mismatch: prefill server has kv_cache_dtype=float8_e4m3fn, but decode server has "
        "kv_cache_dtype=float8_e5m2. Both servers must use the same --kv-cache-dtype value.",
    ),
    (dict(speculative_num_draft_tokens=None), e.LayoutMismatch, _layout("c4_ring", 16, 8)),
    (dict(unified_kv=True), e.LayoutMismatch, _layout("layout", "paged", "unified")),
    (dict(sliding_window=64), e.LayoutMismatch, _layout("sliding_window", 128, 64)),
    (dict(state_dtype="bfloat16"), e.LayoutMismatch, _layout("c4_state_dtype", "float32", "bfloat16")),
    (
        dict(draft_enabled=False),
        e.LayoutMismatch,
        _layout("draft", TINY_DRAFT_FACTOR, None),
    ),
    (
        dict(indexer_head_dim=64),
        e.LayoutMismatch,
        _layout("main_kv_item_lens", [37440, 8448, 1728], [37440, 4352, 1728]),
    ),
]


@pytest.mark.parametrize("changes,cls,message", CROSS_SIDE)
def test_cross_side_mismatch_is_refused_with_the_same_error_on_both_sides(changes, cls, message):
    p, d = prefill(), decode(**changes)
    assert_refused(p, d, cls, message)
    # the decode, checking the prefill's report itself (as on an Accept), reaches the same error
    with pytest.raises(cls) as info:
        h.DecodeHandshake(d).receive(
            wire.Accept(worker_id="p", incarnation="i", report=p.report, heartbeat_interval_s=1, peer_timeout_s=5)
        )
    assert str(info.value) == message


def test_decode_refuses_an_accept_from_an_incompatible_prefill():
    accept = wire.Accept(
        worker_id="prefill-0",
        incarnation="x",
        report=prefill(draft_mapping="clone").report,
        heartbeat_interval_s=1.0,
        peer_timeout_s=5.0,
    )
    with pytest.raises(e.SWAIndexMappingNotShared) as info:
        h.DecodeHandshake(decode()).receive(accept)
    assert str(info.value) == MAPPING_ERROR


def test_engine_name_mismatch_is_refused():
    p = prefill()
    d = h.LocalSide(**{**decode().__dict__, "engine": wire.EngineDesc(name="mooncake", endpoint={"session_id": "h:1"})})
    assert_refused(
        p, d, e.EngineError, "transfer engine mismatch: prefill server uses 'shm', but decode server uses 'mooncake'"
    )


def test_engine_name_is_checked_before_the_layout():
    d = decode(draft_mapping="clone")
    d = h.LocalSide(**{**d.__dict__, "engine": wire.EngineDesc(name="nixl", endpoint={})})
    assert_refused(
        prefill(),
        d,
        e.EngineError,
        "transfer engine mismatch: prefill server uses 'shm', but decode server uses 'nixl'",
    )


def test_unknown_error_type_is_raised_as_runtime_error():
    reject = wire.Reject(worker_id="p", error={"type": "SomethingNew", "message": "m"})
    with pytest.raises(RuntimeError) as info:
        h.DecodeHandshake(decode()).receive(reject)
    assert type(info.value) is e.RemoteError and str(info.value) == "m"
    assert info.value.type_name == "SomethingNew"


# --- descriptor sanity ---------------------------------------------------------------------------


def with_kv(d: h.LocalSide, kv) -> h.LocalSide:
    return h.LocalSide(**{**d.__dict__, "kv": kv})


def edit_component(kv: wire.KVDesc, c: int, **changes) -> wire.KVDesc:
    comps = list(kv.components)
    comps[c] = comps[c].model_copy(update=changes)
    return kv.model_copy(update={"components": comps})


def test_decode_without_buffers_is_refused():
    assert_refused(
        prefill(),
        with_kv(decode(), None),
        e.DescriptorMismatch,
        "decode registered no buffers (its local setup_state_kv_args failed)",
    )


def test_overlapping_ranges_are_refused():
    d = decode()
    ptrs = list(d.kv.components[0].ptrs)
    n = d.kv.components[0].lens[0]
    ptrs[1] = ptrs[0] + n - 1
    kv = edit_component(d.kv, 0, ptrs=ptrs)
    assert_refused(
        prefill(),
        with_kv(d, kv),
        e.DescriptorMismatch,
        f"registered ranges overlap: component 0 (swa)[0] [{ptrs[0]:#x}, +{n}) and component 0 (swa)[1] "
        f"[{ptrs[1]:#x}, +{d.kv.components[0].lens[1]})",
    )


def test_overlap_across_main_kv_and_a_component_is_refused():
    d = decode()
    p0, n0 = d.kv.kv_data_ptrs[0], d.kv.kv_data_lens[0]
    kv = edit_component(d.kv, 1, ptrs=[p0 + 64])
    reply = assert_refused(
        prefill(),
        with_kv(d, kv),
        e.DescriptorMismatch,
        f"registered ranges overlap: main KV[0] [{p0:#x}, +{n0}) and component 1 (c128_state)[0] "
        f"[{p0 + 64:#x}, +{d.kv.components[1].lens[0]})",
    )
    assert reply.error.type == "DescriptorMismatch"


def test_main_kv_item_length_difference_is_refused():
    d = decode()
    kv = d.kv.model_copy(update={"kv_item_lens": [37440, 8448, 1729]})
    assert_refused(
        prefill(),
        with_kv(d, kv),
        e.DescriptorMismatch,
        "main KV item lengths differ: ours=[37440, 8448, 1728], peer=[37440, 8448, 1729]",
    )


def test_component_item_length_difference_is_refused():
    d = decode()
    kv = edit_component(d.kv, 2, item_lens=[149761])
    assert_refused(
        prefill(),
        with_kv(d, kv),
        e.DescriptorMismatch,
        "component 2 (swa) item lengths differ: ours=[149760], peer=[149761]",
    )


def test_component_buffer_count_difference_is_refused():
    d = decode()
    c = d.kv.components[0]
    kv = edit_component(d.kv, 0, ptrs=c.ptrs[:4], lens=c.lens[:4], item_lens=c.item_lens[:4])
    assert_refused(
        prefill(),
        with_kv(d, kv),
        e.DescriptorMismatch,
        "component 0 (swa) item lengths differ: ours=[149760, 149760, 149760, 131072, 32768], "
        "peer=[149760, 149760, 149760, 131072]",
    )


def test_component_type_order_is_refused():
    d = decode()
    comps = d.kv.components
    kv = d.kv.model_copy(update={"components": [comps[0], comps[2], comps[1]]})
    assert_refused(
        prefill(),
        with_kv(d, kv),
        e.DescriptorMismatch,
        "state components differ: ours=['swa', 'c128_state', 'swa'], peer=['swa', 'swa', 'c128_state']",
    )


def test_component_count_is_refused():
    d = decode()
    kv = d.kv.model_copy(update={"components": list(d.kv.components[:2])})
    assert_refused(
        prefill(),
        with_kv(d, kv),
        e.DescriptorMismatch,
        "state components differ: ours=['swa', 'c128_state', 'swa'], peer=['swa', 'c128_state']",
    )


@pytest.mark.parametrize(
    "where,changes,label",
    [
        ("main", {"kv_data_ptrs": [0, 1 << 40, 2 << 40]}, "main KV[0]"),
        ("main", {"kv_data_lens": [187200, 0, 8640]}, "main KV[1]"),
        ("main", {"kv_data_lens": [187200, 42240, (1 << 44) + 1]}, "main KV[2]"),
        ("main", {"kv_data_ptrs": [(1 << 64) - 4096, 1 << 40, 2 << 40]}, "main KV[0]"),
        ("comp", {"lens": [1 << 45]}, "component 1 (c128_state)[0]"),
        ("comp", {"item_lens": [524288], "lens": [1024]}, "component 1 (c128_state)[0]"),
    ],
)
def test_implausible_ranges_are_refused(where, changes, label):
    d = decode()
    kv = d.kv.model_copy(update=changes) if where == "main" else edit_component(d.kv, 1, **changes)
    if where == "main":
        i = int(label[-2])
        p, n, it = kv.kv_data_ptrs[i], kv.kv_data_lens[i], kv.kv_item_lens[i]
    else:
        c = kv.components[1]
        p, n, it = c.ptrs[0], c.lens[0], c.item_lens[0]
    assert_refused(
        prefill(), with_kv(d, kv), e.DescriptorMismatch, f"{label}: implausible range ptr={p:#x} len={n} item_len={it}"
    )


def test_mismatching_pointer_list_lengths_are_refused():
    d = decode()
    kv = d.kv.model_copy(update={"kv_data_ptrs": d.kv.kv_data_ptrs[:2]})
    assert_refused(prefill(), with_kv(d, kv), e.DescriptorMismatch, "main KV: 2 pointers, 3 lengths, 3 item lengths")


def test_layout_is_checked_before_descriptors():
    d = decode(speculative_num_draft_tokens=None)
    kv = d.kv.model_copy(update={"kv_item_lens": [1, 2, 3]})
    assert_refused(prefill(), with_kv(d, kv), e.LayoutMismatch, _layout("c4_ring", 16, 8))


# --- request lifecycle ---------------------------------------------------------------------------


S = lifecycle.RequestState
ORDER = [S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, S.TRANSFERRING, S.SUCCESS, S.FAILED]


def test_transition_table():
    assert lifecycle.TRANSITIONS == {
        S.BOOTSTRAPPING: {S.WAITING_FOR_INPUT, S.FAILED},
        S.WAITING_FOR_INPUT: {S.TRANSFERRING, S.FAILED},
        S.TRANSFERRING: {S.SUCCESS, S.FAILED},
        S.SUCCESS: set(),
        S.FAILED: set(),
    }
    assert set(lifecycle.TRANSITIONS) == set(S)


def _rank(s):
    return {S.BOOTSTRAPPING: 0, S.WAITING_FOR_INPUT: 1, S.TRANSFERRING: 2, S.SUCCESS: 3, S.FAILED: 3}[s]


@pytest.mark.parametrize("a,b", list(itertools.product(ORDER, ORDER)))
def test_only_forward_moves_are_allowed(a, b):
    if b in lifecycle.TRANSITIONS[a]:
        assert _rank(b) > _rank(a)
        assert lifecycle.advance(a, b) is b
    else:
        with pytest.raises(lifecycle.IllegalTransition) as info:
            lifecycle.advance(a, b)
        assert str(info.value) == f"request cannot move from {a.value} to {b.value}"


@pytest.mark.parametrize("terminal", [S.SUCCESS, S.FAILED])
def test_terminal_states_are_final(terminal):
    assert terminal.terminal
    for new in S:
        with pytest.raises(lifecycle.IllegalTransition):
            lifecycle.advance(terminal, new)


def test_every_non_terminal_state_can_fail():
    for s in ORDER:
        assert s.terminal == (s in (S.SUCCESS, S.FAILED))
        if not s.terminal:
            assert lifecycle.advance(s, S.FAILED) is S.FAILED


def test_happy_path():
    s = S.BOOTSTRAPPING
    for nxt in (S.WAITING_FOR_INPUT, S.TRANSFERRING, S.SUCCESS):
        s = lifecycle.advance(s, nxt)
    assert s is S.SUCCESS


def test_illegal_transition_is_a_runtime_error():
    assert issubclass(lifecycle.IllegalTransition, RuntimeError)
    with pytest.raises(lifecycle.IllegalTransition, match="^request cannot move from bootstrapping to success$"):
        lifecycle.advance(S.BOOTSTRAPPING, S.SUCCESS)
