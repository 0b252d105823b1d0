"""Layout reports: what each side states about its pools, and the fingerprint over it.

A ``LayoutReport`` carries
- ``factors``: the layout factors that must be equal on both sides (spec §6), as an ordered tuple
  of ``(name, value)`` pairs: the same order is used to hash them and to explain a difference;
- the side's own ``target`` and ``draft`` facts (geometry tuples, mapping identities), so the peer
  can re-run the five upstream checks on them;
- the outcome of the side's own ``setup_state_kv_args``.

Factors that legitimately differ (pool sizes, ``num_req_slots``, ring pages, data lengths,
pointers) stay out of the factors. A mapping is never compared across processes.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack
from pydantic import BaseModel, ConfigDict

from pdstate.kvargs import KVArgs, PoolFacts, fill_kv_args, state_components
from pdstate.pools.allocator import MappingIdentity
from pdstate.pools.dsv4 import DeepSeekV4TokenToKVPool, dtype_name

# The order is part of the protocol: it is hashed in this order and differences are named in it.
FACTOR_NAMES: tuple[str, ...] = (
    "layout",
    "compression_ratios",
    "stage",
    "sliding_window",
    "c4_ring",
    "c128_ring",
    "online_c128",
    "c4_state_dtype",
    "c128_state_dtype",
    "draft",
    "main_kv_item_lens",
    "components",
)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class MappingIdentityModel(_Frozen):
    nonce: str
    data_ptr: int
    numel: int
    dtype: str


class PoolFactsModel(_Frozen):
    compression_ratios: tuple[int, ...]
    unified_kv: bool
    ring_geometry: tuple[int, int, int] | None
    paged_geometry: tuple[int, int]
    mapping_identity: MappingIdentityModel | None

    @classmethod
    def of(cls, facts: PoolFacts) -> "PoolFactsModel":
        mi = facts.mapping_identity
        return cls(
            compression_ratios=facts.compression_ratios,
            unified_kv=facts.unified_kv,
            ring_geometry=facts.ring_geometry,
            paged_geometry=facts.paged_geometry,
            mapping_identity=None if mi is None else MappingIdentityModel(**mi.as_dict()),
        )

    def to_facts(self) -> PoolFacts:
        mi = self.mapping_identity
        return PoolFacts(
            tuple(self.compression_ratios),
            self.unified_kv,
            None if self.ring_geometry is None else tuple(self.ring_geometry),
            tuple(self.paged_geometry),
            None if mi is None else MappingIdentity(mi.nonce, mi.data_ptr, mi.numel, mi.dtype),
        )


class ErrorInfo(_Frozen):
    type: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> "ErrorInfo":
        return cls(type=type(exc).__name__, message=str(exc))


class LocalCheck(_Frozen):
    ok: bool
    error: ErrorInfo | None = None


class LayoutReport(_Frozen):
    page_size: int
    kv_dtype: str
    factors: tuple[tuple[str, Any], ...]
    fingerprint: str
    target: PoolFactsModel
    draft: PoolFactsModel | None
    local_check: LocalCheck

    def factor(self, name: str) -> Any:
        return dict(self.factors)[name]


def _canon(value: Any) -> Any:
    """Tuples -> lists recursively, so a report survives a msgpack/JSON round trip unchanged."""
    if isinstance(value, (list, tuple)):
        return [_canon(v) for v in value]
    if isinstance(value, dict):
        return {k: _canon(v) for k, v in value.items()}
    return value


def fingerprint(page_size: int, kv_dtype: str, factors: tuple[tuple[str, Any], ...]) -> str:
    """blake2b-128 hex digest over page size, KV dtype and the factors, in ``FACTOR_NAMES`` order."""
    payload = msgpack.packb(
        [["page_size", page_size], ["kv_dtype", kv_dtype]] + [[n, _canon(v)] for n, v in factors],
        use_bin_type=True,
    )
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def _components(target: DeepSeekV4TokenToKVPool, draft: DeepSeekV4TokenToKVPool | None) -> list:
    """``[state_type, n_buffers, item_lens]`` per component, described without the pair checks."""
    return [[st.value, len(ptrs), list(items)] for st, (ptrs, _, items) in state_components(target, draft, check=False)]


def draft_descriptor(draft: DeepSeekV4TokenToKVPool | None) -> dict | None:
    if draft is None:
        return None
    return {
        "layers": len(draft.stage_ratios),
        "layout": "unified" if draft._unified_kv else "paged",
        "page_size": draft.page_size,
        "swa_page_size": draft.swa_page_size,
        "sliding_window": draft.sliding_window,
        "ring_size": draft.unified_swa_ring_size if draft._unified_kv else None,
    }


def build_report(
    target: DeepSeekV4TokenToKVPool,
    draft: DeepSeekV4TokenToKVPool | None,
    kv_args: KVArgs | None = None,
) -> tuple[LayoutReport, KVArgs | None]:
    """Report a side's layout. Runs ``setup_state_kv_args`` and records its outcome.

    Returns the report and the filled ``KVArgs`` (``None`` when the local check failed).
    """
    error: BaseException | None = None
    if kv_args is None:
        try:
            kv_args = fill_kv_args(target, draft)
        except RuntimeError as exc:  # the upstream refusals (AttributeError subclass included)
            error = exc
            kv_args = None
    factors = (
        ("layout", "unified" if target._unified_kv else "paged"),
        ("compression_ratios", list(target.stage_ratios)),
        ("stage", [target._stage_start, target._stage_end]),
        ("sliding_window", target.sliding_window),
        ("c4_ring", target.c4_ring_size),
        ("c128_ring", target.c128_ring_size),
        ("online_c128", target.online_c128),
        ("c4_state_dtype", dtype_name(target.c4_state_dtype)),
        ("c128_state_dtype", dtype_name(target.c128_state_dtype)),
        ("draft", draft_descriptor(draft)),
        ("main_kv_item_lens", list(target.get_contiguous_buf_infos()[2])),
        ("components", _components(target, draft)),
    )
    assert tuple(n for n, _ in factors) == FACTOR_NAMES
    kv_dtype = dtype_name(target.dtype)
    report = LayoutReport(
        page_size=target.page_size,
        kv_dtype=kv_dtype,
        factors=factors,
        fingerprint=fingerprint(target.page_size, kv_dtype, factors),
        target=PoolFactsModel.of(PoolFacts.of(target)),
        draft=None if draft is None else PoolFactsModel.of(PoolFacts.of(draft)),
        local_check=LocalCheck(ok=error is None, error=None if error is None else ErrorInfo.of(error)),
    )
    return report, kv_args


def diff(ours: LayoutReport, theirs: LayoutReport) -> list[tuple[str, Any, Any]]:
    """Every differing factor, in protocol order, as ``(name, ours, theirs)``."""
    out = []
    if ours.page_size != theirs.page_size:
        out.append(("page_size", ours.page_size, theirs.page_size))
    if ours.kv_dtype != theirs.kv_dtype:
        out.append(("kv_dtype", ours.kv_dtype, theirs.kv_dtype))
    a, b = dict(ours.factors), dict(theirs.factors)
    for name in FACTOR_NAMES:
        if _canon(a.get(name)) != _canon(b.get(name)):
            out.append((name, a.get(name), b.get(name)))
    return out
