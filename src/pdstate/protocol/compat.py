"""Compatibility of two workers' layout reports, with the same errors on both sides.

``check_peer(ours, theirs, our_role)`` raises, in this order and stopping at the first failure:
1. what the peer would raise about its own target/draft pair: the five upstream checks re-run on
   the reported facts, the mapping check comparing recorded mapping identities (e.g. a peer whose
   draft has its own mapping -> ``SWAIndexMappingNotShared``);
2. the upstream cross-side sentences (the registry's factors with a ``refusal`` of their own,
   ``pdstate.protocol.factors``): ``PageSizeMismatch``, then ``KVCacheDtypeMismatch``, then
   SGLang 0.5.23's (``KVLayoutMismatch``, ``CompressedMLAPoolMismatch``, ``DSparkLayoutMismatch``,
   ``AllocationPolicyMismatch``). pdstate compares these whatever release either side runs (a
   0.5.19 pool states the default layout), where 0.5.23 compares them only between two 0.5.23
   servers;
3. ``LayoutMismatch`` naming the first other differing factor (in the registry's order) with
   both values, prefill's first.

Each factor is compared by its entry's rule (``Factor.same``, in ``report.diff``).

``check_descriptors`` then vets the peer's registered buffers against ours before any request.
Everything here is pure: the handshake calls it, and so do ``/v1/compat/check`` and
``pdstate check``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pdstate.errors import (
    WIRE_TYPES,
    CrossSideMismatch,
    DescriptorMismatch,
    DraftMappingMissing,
    DSV4StateError,
    PdStateError,
    error_from_wire,
)
from pdstate.protocol import factors
from pdstate.protocol.facts import check_draft_pair, identities_shared
from pdstate.protocol.report import ErrorInfo, LayoutReport, diff

Role = Literal["prefill", "decode"]

# Plausibility bound for one registered range (a whole host's memory is far below this).
MAX_REGION_BYTES = 1 << 44


def check_own_pair(report: LayoutReport) -> None:
    """Re-run the five upstream checks on a report's target/draft facts.

    Where they refuse the pair and the side's own check refused it too, the side's own error is
    raised (its class and text): the texts differ between SGLang releases (0.5.19's "paged SWA
    geometry" is 0.5.23's "SWA geometry" with a third element), and the side's pools are of its
    release. A pair the side itself passed is still refused by the re-run, in this side's words."""
    try:
        _recheck_own_pair(report)
    except DSV4StateError:
        own = report.local_check.error
        if own is not None and issubclass(WIRE_TYPES.get(own.type, PdStateError), DSV4StateError):
            raise error_from_wire(own.type, own.message) from None
        raise


def _recheck_own_pair(report: LayoutReport) -> None:
    if report.draft is None:
        return
    t, d = report.target.to_facts(), report.draft.to_facts()

    def mapping_shared() -> bool:
        # In process, reading an unregistered mapping raises ``DraftMappingMissing`` on SGLang
        # 0.5.19's pools, before the identity comparison; 0.5.23's pools hold ``None`` there, which
        # is not the target's mapping (the seed error). The peer says which in its own check.
        if t.mapping_identity is None or d.mapping_identity is None:
            own = report.local_check.error
            if own is None or own.type == DraftMappingMissing.__name__:
                raise DraftMappingMissing()
            return False
        return identities_shared(t, d)

    check_draft_pair(t, d, mapping_shared)


def upstream_mismatch(name: str, prefill: LayoutReport, decode: LayoutReport) -> CrossSideMismatch:
    """The refusal, in upstream's own words, of a pair differing in factor ``name`` (one refused
    in upstream's words: ``Factor.refusal``)."""
    entry = factors.get(name)
    if entry is None or entry.refusal is None:
        raise ValueError(f"{name!r} is not one of {tuple(f.name for f in factors.refusal_order() if f.refusal)}")
    return entry.refuse(prefill, decode)


def _cross_side(prefill: LayoutReport, decode: LayoutReport) -> list[CrossSideMismatch]:
    """Every cross-side refusal of the pair, in the order ``check_peer`` raises them
    (``factors.refusal_order``)."""
    differing = {name for name, _, _ in diff(prefill, decode)}
    return [entry.refuse(prefill, decode) for entry in factors.refusal_order() if entry.name in differing]


def check_peer(ours: LayoutReport, theirs: LayoutReport, our_role: Role) -> None:
    check_own_pair(theirs)
    prefill, decode = (ours, theirs) if our_role == "prefill" else (theirs, ours)
    for refusal in _cross_side(prefill, decode):
        raise refusal


def compat_errors(ours: LayoutReport, theirs: LayoutReport, our_role: Role) -> list[ErrorInfo]:
    """Every reason the pair cannot work, for an operator's preflight (first one is what the
    handshake raises). Empty when compatible."""
    errors: list[ErrorInfo] = []
    try:
        check_own_pair(theirs)
    except RuntimeError as exc:
        errors.append(ErrorInfo.of(exc))
    try:
        check_own_pair(ours)
    except RuntimeError as exc:
        errors.append(ErrorInfo.of(exc))
    prefill, decode = (ours, theirs) if our_role == "prefill" else (theirs, ours)
    errors += [ErrorInfo.of(refusal) for refusal in _cross_side(prefill, decode)]
    return errors


def check_ranges(label: str, ptrs: Sequence[int], lens: Sequence[int], items: Sequence[int]) -> None:
    """Each range is plausible (positive, whole items, bounded) and no two ranges overlap."""
    if not (len(ptrs) == len(lens) == len(items)):
        raise DescriptorMismatch(f"{label}: {len(ptrs)} pointers, {len(lens)} lengths, {len(items)} item lengths")
    for i, (p, n, it) in enumerate(zip(ptrs, lens, items)):
        if p <= 0 or n <= 0 or it <= 0 or n > MAX_REGION_BYTES or p + n >= 1 << 64 or it > n:
            raise DescriptorMismatch(f"{label}[{i}]: implausible range ptr={p:#x} len={n} item_len={it}")


def check_no_overlap(ranges: Sequence[tuple[int, int, str]]) -> None:
    ordered = sorted(ranges)
    for (p0, n0, l0), (p1, n1, l1) in zip(ordered, ordered[1:]):
        if p0 + n0 > p1:
            raise DescriptorMismatch(f"registered ranges overlap: {l0} [{p0:#x}, +{n0}) and {l1} [{p1:#x}, +{n1})")


def check_descriptors(ours, theirs) -> None:
    """The peer's ``KVArgs``-like descriptors pair with ours buffer by buffer.

    Both arguments expose ``kv_data_ptrs/lens/item_lens`` and per-component ``state_types``,
    ``state_data_ptrs/lens``, ``state_item_lens``.
    """
    check_ranges("main KV", theirs.kv_data_ptrs, theirs.kv_data_lens, theirs.kv_item_lens)
    if list(theirs.kv_item_lens) != list(ours.kv_item_lens):
        raise DescriptorMismatch(
            f"main KV item lengths differ: ours={list(ours.kv_item_lens)}, peer={list(theirs.kv_item_lens)}"
        )
    our_types = [getattr(t, "value", t) for t in ours.state_types]
    their_types = [getattr(t, "value", t) for t in theirs.state_types]
    if our_types != their_types:
        raise DescriptorMismatch(f"state components differ: ours={our_types}, peer={their_types}")
    ranges = [(p, n, f"main KV[{i}]") for i, (p, n) in enumerate(zip(theirs.kv_data_ptrs, theirs.kv_data_lens))]
    for c, st in enumerate(their_types):
        label = f"component {c} ({st})"
        check_ranges(label, theirs.state_data_ptrs[c], theirs.state_data_lens[c], theirs.state_item_lens[c])
        if list(theirs.state_item_lens[c]) != list(ours.state_item_lens[c]):
            raise DescriptorMismatch(
                f"{label} item lengths differ: ours={list(ours.state_item_lens[c])}, "
                f"peer={list(theirs.state_item_lens[c])}"
            )
        ranges += [
            (p, n, f"{label}[{i}]")
            for i, (p, n) in enumerate(zip(theirs.state_data_ptrs[c], theirs.state_data_lens[c]))
        ]
    check_no_overlap(ranges)
