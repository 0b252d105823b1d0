"""Layout reports: what each side states about its pools, the fingerprint over it, the diff.

A ``LayoutReport`` carries
- ``factors``: the layout factors that must be equal on both sides (spec §6), as an ordered tuple
  of ``(name, value)`` pairs: the same order is used to hash them and to explain a difference;
- the side's own ``target`` and ``draft`` facts (geometry tuples, mapping identities), so the peer
  can re-run the five upstream checks on them;
- the outcome of the side's own ``setup_state_kv_args``.

Factors that legitimately differ (pool sizes, ``num_req_slots``, ring pages, data lengths,
pointers) stay out of the factors. A mapping is never compared across processes.

Reports are data (no torch): ``pdstate.pools.reporting.build_report`` builds one from live pools.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack
from pydantic import BaseModel, ConfigDict

from pdstate.protocol.facts import MappingIdentity, PoolFacts

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
    def of(cls, facts: PoolFacts) -> PoolFactsModel:
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
    def of(cls, exc: BaseException) -> ErrorInfo:
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
