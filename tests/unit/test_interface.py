"""Pools by interface: which objects count as DSV4 pools, and what ``PoolView`` derives.

``UpstreamShaped`` carries only the attributes SGLang 0.5.19's ``DeepSeekV4TokenToKVPool`` has
(none of pdstate's own facts), over a pdstate pool's buffers; tests/sglang does the same with the
real SGLang objects.
"""

from types import SimpleNamespace

import pytest
import torch

from pdstate.errors import DraftMappingMissing, SWAIndexMappingNotShared
from pdstate.pools import DeepSeekV4TokenToKVPool as PdPool
from pdstate.pools import SWATokenToKVPoolAllocator
from pdstate.pools.interface import PoolView, is_dsv4_pool, pool_view
from pdstate.pools.kvargs import KVArgs, StateType, pool_facts, setup_state_kv_args
from pdstate.pools.reporting import build_report
from pdstate.protocol.compat import check_peer
from pdstate.protocol.facts import MappingIdentity
from tests.support.pools import UPSTREAM_KWARGS

SEED = "DSV4 target and draft pools must share the SWA index mapping"
MISSING_MSG = "'DeepSeekV4TokenToKVPool' object has no attribute 'full_to_swa_index_mapping'"
UPSTREAM_TINY = UPSTREAM_KWARGS
NEXTN = dict(c4_size=0, c128_size=0, c4_state_pool_size=0, c128_state_pool_size=0, layer_num=1, compression_ratios=[0])


def target(**over) -> PdPool:
    return PdPool(**{**UPSTREAM_TINY, **over})


def draft(**over) -> PdPool:
    return PdPool(**{**UPSTREAM_TINY, **NEXTN, **over})


_GEOMETRY = (  # what both releases' pools name alike
    "compression_ratios",
    "_unified_kv",
    "_stage_start",
    "_stage_end",
    "page_size",
    "swa_page_size",
    "sliding_window",
    "dtype",
)
_UPSTREAM_ATTRS = (
    *_GEOMETRY,
    "c4_state_dtype",
    "c128_state_dtype",
    "get_contiguous_buf_infos",
    "get_state_buf_infos",
    "get_unified_swa_ring_buf_infos",
    "get_c128_state_buf_infos",
)


def compress_state_pools(pool: PdPool) -> list:
    """Upstream's per-layer compress-state pools (``None`` for an uncompressed layer) of ``pool``'s stage."""
    pools: list = [None] * len(pool.compression_ratios)
    for layer in range(pool._stage_start, pool._stage_end):
        r = pool.compression_ratios[layer]
        if r:
            ring = pool.c4_ring_size if r == 4 else pool.c128_ring_size
            pools[layer] = SimpleNamespace(ratio=r, ring_size=ring, online=r == 128 and pool.online_c128)
    return pools


class _Shaped:
    def __init__(self, pool: PdPool) -> None:
        for name in _UPSTREAM_ATTRS:
            setattr(self, name, getattr(pool, name))
        if pool._unified_kv:
            self.unified_swa_window = pool.unified_swa_window
            self.unified_swa_ring_size = pool.unified_swa_ring_size
            self.unified_swa_pages = pool.unified_swa_pages
        self._spec = pool.speculative
        self.compress_state_pools = compress_state_pools(pool)

    def register_mapping(self, mapping: torch.Tensor) -> None:
        self.full_to_swa_index_mapping = mapping

    def get_ring_size(self, ratio: int) -> int:
        return (16 if self._spec else 8) if ratio == 4 else (256 if self._spec else 128)


class DeepSeekV4TokenToKVPool(_Shaped):
    """Upstream's class name, upstream's attributes."""


class NPUSubclass(DeepSeekV4TokenToKVPool):
    pass


class SomeOtherPool(_Shaped):
    """Upstream's attributes, but not a DSV4 pool class: upstream skips it as a draft."""


def shaped(pool: PdPool, cls=DeepSeekV4TokenToKVPool):
    return cls(pool)


def pair(how: str = "shared", unified: bool = False, cls=DeepSeekV4TokenToKVPool):
    return _mapped(how, shaped(target(unified_kv=unified), cls), shaped(draft(unified_kv=unified), cls))


def _mapped(how: str, t, d) -> tuple:
    """``t`` given an allocator; the draft ``d`` shares its mapping (``shared``), has its own
    (``own``) or none."""
    a = SWATokenToKVPoolAllocator(1024, 512, 256, kvcache=t)
    if how == "shared":
        d.register_mapping(a.full_to_swa_index_mapping)
    elif how == "own":
        SWATokenToKVPoolAllocator(1024, 512, 256, kvcache=d)
    return t, d


# --- the rule --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "obj,want",
    [
        (target(), True),
        (shaped(target()), True),
        (shaped(target(), NPUSubclass), True),
        (shaped(target(), SomeOtherPool), False),
        (object(), False),
        (None, False),
        ("DeepSeekV4TokenToKVPool", False),
    ],
)
def test_is_dsv4_pool_is_upstreams_isinstance_by_class_name(obj, want):
    assert is_dsv4_pool(obj) is want


def test_non_dsv4_draft_is_skipped_even_with_the_interface():
    t, _ = pair()
    other = shaped(draft(), SomeOtherPool)
    kv = setup_state_kv_args(KVArgs(), t, other)
    assert kv.state_types == [StateType.SWA, StateType.C128_STATE]
    report, _ = build_report(t, other)
    assert report.draft is None and report.factor("draft") is None


def test_target_must_be_a_dsv4_pool():
    with pytest.raises(TypeError, match="pdstate handles DSV4 pools; got SomeOtherPool"):
        setup_state_kv_args(KVArgs(), shaped(target(), SomeOtherPool))


# --- the view -------------------------------------------------------------------------------------


@pytest.mark.parametrize("unified", [False, True])
@pytest.mark.parametrize("spec", [4, None])
def test_view_derives_pdstate_facts_from_upstream_attributes(unified, spec):
    own = target(unified_kv=unified, speculative_num_draft_tokens=spec)
    v, mine = pool_view(shaped(own)), pool_view(own)
    for name in (
        "compression_ratios",
        "unified_kv",
        "stage",
        "stage_ratios",
        "ring_geometry",
        "paged_geometry",
        "c4_ring_size",
        "c128_ring_size",
        "online_c128",
        "unified_swa_ring_size",
    ):
        assert getattr(v, name) == getattr(mine, name), name
    assert mine.stage_ratios == own.stage_ratios and mine.ring_geometry == own.ring_geometry


def test_view_without_c128_layers_reports_no_c128_ring():
    v = pool_view(shaped(target(compression_ratios=[0, 4], layer_num=2)))
    assert v.c128_ring_size is None and v.online_c128 is False
    assert v.c4_ring_size == 16


def test_mapping_identity_is_that_of_the_object():
    t, d = pair("shared")
    assert pool_view(t).mapping_identity == pool_view(d).mapping_identity
    assert pool_view(t).mapping_identity == MappingIdentity.of(t.full_to_swa_index_mapping)
    clone = shaped(draft())
    clone.register_mapping(t.full_to_swa_index_mapping.clone())
    assert pool_view(clone).mapping_identity != pool_view(t).mapping_identity
    view = shaped(draft())
    view.register_mapping(t.full_to_swa_index_mapping[:])
    assert pool_view(view).mapping_identity != pool_view(t).mapping_identity


def test_missing_mapping_reads_as_upstream_attribute_error():
    d = shaped(draft())
    with pytest.raises(DraftMappingMissing) as info:
        _ = pool_view(d).mapping
    assert isinstance(info.value, AttributeError) and str(info.value) == MISSING_MSG
    assert pool_view(d).mapping_identity is None
    assert pool_facts(d).mapping_identity is None


def test_pool_view_of_a_view_is_itself():
    v = pool_view(target())
    assert pool_view(v) is v and isinstance(v, PoolView)


# --- what reads pools ------------------------------------------------------------------------------


@pytest.mark.parametrize("unified", [False, True])
def test_report_of_upstream_shaped_pools_equals_pdstate_pools(unified):
    t, d = pair(unified=unified)
    assert pool_view(t).release == "0.5.19"  # 0.5.19's interface
    own_t, own_d = target(unified_kv=unified, upstream="0.5.19"), draft(unified_kv=unified, upstream="0.5.19")
    SWATokenToKVPoolAllocator(1024, 512, 256, kvcache=own_t)
    own_d.register_mapping(own_t.full_to_swa_index_mapping)
    a, b = build_report(t, d)[0], build_report(own_t, own_d)[0]
    assert a.factors == b.factors and a.fingerprint == b.fingerprint
    assert a.local_check.ok
    check_peer(a, b, "prefill")


def test_kvargs_of_upstream_shaped_pools_are_the_pools_buffers():
    own = target()
    t = shaped(own)
    d = shaped(draft())
    SWATokenToKVPoolAllocator(1024, 512, 256, kvcache=t)
    d.register_mapping(t.full_to_swa_index_mapping)
    kv = setup_state_kv_args(KVArgs(), t, d)
    assert kv.state_types == [StateType.SWA, StateType.C128_STATE, StateType.SWA]
    assert kv.state_data_ptrs[:2] == [own.get_state_buf_infos()[0], own.get_c128_state_buf_infos()[0]]


def test_own_mapping_gives_the_seed_error_locally_and_from_the_peer():
    t, d = pair("own")
    with pytest.raises(SWAIndexMappingNotShared) as info:
        setup_state_kv_args(KVArgs(), t, d)
    assert str(info.value) == SEED
    theirs = build_report(t, d)[0]
    assert not theirs.local_check.ok and theirs.local_check.error.message == SEED
    good = build_report(*pair("shared"))[0]
    for role in ("prefill", "decode"):
        with pytest.raises(SWAIndexMappingNotShared, match=SEED):
            check_peer(good, theirs, role)


def test_unified_never_reads_the_mapping():
    t, d = pair("missing", unified=True)
    assert setup_state_kv_args(KVArgs(), t, d).state_types[-1] == StateType.SWA_RING


# --- SGLang 0.5.23's interface ------------------------------------------------------------------


class DeepSeekV4TokenToKVPool23:
    """Stands in for 0.5.23's pool: the attributes it has (renamed methods, state dtypes in
    ``compressed_pool_configs``, ``None`` as the mapping until registered, the geometry facts)."""

    def __init__(self, pool: PdPool) -> None:
        assert pool.upstream == "0.5.23"
        for name in (
            *_GEOMETRY,
            "get_contiguous_buf_infos",
            "get_state_buf_infos",
            "get_unified_swa_ring_buf_infos",
            "get_request_state_buf_infos",
            "get_swa_valid_from_buf_infos",
            "swa_req_ring_size",
        ):
            setattr(self, name, getattr(pool, name))
        if pool._unified_kv:
            self.unified_swa_window = pool.unified_swa_window
            self.unified_swa_ring_size = pool.unified_swa_ring_size
            self.unified_swa_pages = pool.unified_swa_pages
        self.request_window = None
        self.full_to_swa_index_mapping = None
        self.compressed_pool_configs = {
            r: SimpleNamespace(state_dtype=getattr(pool, f"c{r}_state_dtype"))
            for r in (4, 128)
            if r in pool.compression_ratios
        }
        self.compress_state_pools = compress_state_pools(pool)

    def register_mapping(self, mapping: torch.Tensor) -> None:
        self.full_to_swa_index_mapping = mapping


DeepSeekV4TokenToKVPool23.__name__ = "DeepSeekV4TokenToKVPool"


def pair23(how: str = "shared", unified: bool = False, **over):
    t = DeepSeekV4TokenToKVPool23(target(unified_kv=unified, upstream="0.5.23", **over))
    return _mapped(how, t, DeepSeekV4TokenToKVPool23(draft(unified_kv=unified, upstream="0.5.23", **over)))


def test_release_of_pools():
    assert pool_view(target(upstream="0.5.19")).release == "0.5.19"
    assert pool_view(target()).release == "0.5.23" == target().upstream
    assert pool_view(shaped(target(upstream="0.5.19"))).release == "0.5.19"
    t, _ = pair23()
    assert is_dsv4_pool(t) and pool_view(t).release == "0.5.23"


def test_0_5_23_state_dtypes_come_from_the_compressed_pool_configs():
    t, _ = pair23()
    v = pool_view(t)
    assert not hasattr(t, "c4_state_dtype")
    assert v.c4_state_dtype == v.c128_state_dtype == torch.float32
    t2 = DeepSeekV4TokenToKVPool23(target(upstream="0.5.23", compression_ratios=[0, 4, 4]))
    assert pool_view(t2).c128_state_dtype is None


@pytest.mark.parametrize("unified", [False, True])
def test_report_of_0_5_23_shaped_pools_equals_pdstate_pools(unified):
    t, d = pair23(unified=unified)
    own_t, own_d = target(unified_kv=unified), draft(unified_kv=unified)
    SWATokenToKVPoolAllocator(1024, 512, 256, kvcache=own_t)
    own_d.register_mapping(own_t.full_to_swa_index_mapping)
    a, b = build_report(t, d)[0], build_report(own_t, own_d)[0]
    assert a.factors == b.factors and a.fingerprint == b.fingerprint
    assert a.local_check.ok
    kv = setup_state_kv_args(KVArgs(), t, d)
    assert kv.state_types[:2] == [StateType.SWA, StateType.SWA_RING if unified else StateType.DSV4_REQUEST_STATE]


def test_0_5_23_draft_without_mapping_is_the_seed_error():
    """0.5.23 holds ``None`` before ``register_mapping``: the identity check refuses it."""
    t, d = pair23(how="none")
    assert pool_view(d).mapping is None and pool_view(d).mapping_identity is None
    with pytest.raises(SWAIndexMappingNotShared) as info:
        setup_state_kv_args(KVArgs(), t, d)
    assert str(info.value) == SEED
    report, kv = build_report(t, d)
    assert kv is None and report.local_check.error.type == "SWAIndexMappingNotShared"


def test_0_5_23_geometry_facts():
    t, d = pair23(unified=True)
    facts = pool_facts(d)
    assert facts.release == "0.5.23" and facts.swa_req_ring_size == 131 and facts.request_window_capacity is None
    t, d = pair23()
    assert pool_view(d).swa_req_ring_size is None
    assert pool_view(t).request_window_capacity is None
