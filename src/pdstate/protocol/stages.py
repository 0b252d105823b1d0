"""A pipeline-parallel prefill stage facing a decode of the whole model: the decode's view of itself
sliced to the stage's layers (no torch).

SGLang's prefill stage ``[start, end)`` of a DeepSeek-V4 model registers buffers for its own layers
only; a decode of one stage registers every layer. SGLang's own backends slice the decode's pointer
lists on the prefill, per buffer group (``CommonKVManager._mla_slice_ptrs_for_pp``); pdstate's
decode does the same to itself instead (``stage_view``), and faces the stage through an agent of
that view: the stage and the view then have the same layout, so the handshake compares every
factor as for any pair (a stage whose layers differ from what the decode computed is refused,
naming ``stage``), the prefill plans as for equal layouts, and the decode's digest covers exactly
the stage's buffers. The groups, as SGLang's DeepSeek-V4 pools list them:

- main KV: ``[C4 KV | C4 indexer KV | C128 KV]``, each by the ratio's layer offset;
- the SWA state component: ``[SWA KV per layer | C4 compress state | C4 indexer compress state]``;
- the C128 (request) state component: by C128 layer offset; a unified SWA ring: by layer.

The aux buffers go whole (every stage sends the request's row, as SGLang's do). A draft model's
KV (entries past the target's, or a second SWA component), and a stage with no layer of one of
the decode's state components (its pools have no such component), have no stage slice here:
``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdstate.protocol.facts import KVArgs
from pdstate.protocol.report import LayoutReport, fingerprint

__all__ = ["StageSlice", "stage_report", "stage_slice", "stage_view"]

_SWA, _C128, _RING = "swa", "c128_state", "swa_ring"


@dataclass(frozen=True)
class StageSlice:
    """Which entries of the decode's main-KV list and of each state component's list the stage
    ``[start, end)`` holds, in the stage's own order."""

    start: int
    end: int
    main: tuple[int, ...]
    components: tuple[tuple[int, ...], ...]


def _value(state_type: Any) -> str:
    return str(getattr(state_type, "value", state_type))


def stage_slice(ratios, start: int, end: int, main_len: int, components: list[tuple[Any, int]]) -> StageSlice:
    """The stage ``[start, end)`` of a decode whose pools hold every layer of ``ratios`` (their
    compression ratios), ``main_len`` main-KV entries and ``components`` as ``(state_type, entries)``."""
    ratios = list(ratios)
    if not 0 <= start < end <= len(ratios):
        raise ValueError(f"PP stage [{start}, {end}) is not a slice of the decode's {len(ratios)} layers")

    def offsets(ratio: int) -> tuple[int, int, int]:
        return (ratios[:start].count(ratio), ratios[:end].count(ratio), ratios.count(ratio))

    c4s, c4e, c4 = offsets(4)
    c128s, c128e, c128 = offsets(128)
    if main_len != 2 * c4 + c128:
        raise ValueError(
            f"the decode registers {main_len} main-KV buffers, not the target's {2 * c4 + c128} (a draft model's "
            "KV): pdstate's SGLang backend moves no draft KV from a pipeline-parallel prefill"
        )
    main = [*range(c4s, c4e), *range(c4 + c4s, c4 + c4e), *range(2 * c4 + c128s, 2 * c4 + c128e)]
    out, swa_seen = [], False
    for state_type, n in components:
        kind = _value(state_type)
        if kind == _SWA and not swa_seen:
            swa = n - 2 * c4
            if not 0 <= swa <= len(ratios):
                raise ValueError(f"an SWA state component of {n} buffers does not fit {c4} C4 layers")
            picked = [*range(min(start, swa), min(end, swa)), *range(swa + c4s, swa + c4e)]
            out.append((*picked, *range(swa + c4 + c4s, swa + c4 + c4e)))
            swa_seen = True
        elif kind == _C128 and n == c128:
            out.append(tuple(range(c128s, c128e)))
        elif kind == _RING:
            out.append(tuple(range(min(start, n), min(end, n))))
        else:
            raise ValueError(
                f"state component {kind!r} ({n} buffers) has no PP stage slice: pdstate's SGLang backend moves "
                "no draft state from a pipeline-parallel prefill"
            )
    empty = [_value(t) for (t, _), idx in zip(components, out) if not idx]
    if empty:  # such a stage's pools have no such component at all: the lists would not pair up
        raise ValueError(
            f"PP stage [{start}, {end}) has no layer of the decode's state components {empty}: pdstate's SGLang "
            "backend pairs a stage's state components with the decode's one for one"
        )
    return StageSlice(start, end, tuple(main), tuple(out))


def _pick(values: list, index: tuple[int, ...]) -> list:
    return [values[i] for i in index] if values else []


def stage_view(kv_args, cut: StageSlice) -> KVArgs:
    """The decode's ``kv_args`` (SGLang's or pdstate's) as the stage ``cut`` sees it."""
    comps = cut.components

    def each(field: str) -> list[list]:
        lists = list(getattr(kv_args, field, None) or [])
        return [_pick(list(lst), idx) for lst, idx in zip(lists, comps)] if lists else []

    return KVArgs(
        engine_rank=kv_args.engine_rank,
        kv_data_ptrs=_pick(list(kv_args.kv_data_ptrs), cut.main),
        kv_data_lens=_pick(list(kv_args.kv_data_lens), cut.main),
        kv_item_lens=_pick(list(kv_args.kv_item_lens), cut.main),
        aux_data_ptrs=list(kv_args.aux_data_ptrs),
        aux_data_lens=list(kv_args.aux_data_lens),
        aux_item_lens=list(kv_args.aux_item_lens),
        state_types=list(kv_args.state_types),
        state_data_ptrs=each("state_data_ptrs"),
        state_data_lens=each("state_data_lens"),
        state_item_lens=each("state_item_lens"),
        state_dim_per_tensor=each("state_dim_per_tensor"),
        state_layer_ids=each("state_layer_ids"),
        page_size=kv_args.page_size,
        kv_cache_dtype=str(getattr(kv_args, "kv_cache_dtype", "") or ""),
        gpu_id=getattr(kv_args, "gpu_id", 0),
        prefill_start_layer=cut.start,
        prefill_end_layer=cut.end,
    )


def stage_report(report: LayoutReport, cut: StageSlice) -> LayoutReport:
    """The decode's ``report`` as a prefill stage ``cut`` of the same model reports itself: its
    layers' ratios and bounds, their buffers' item lengths; a ring of a ratio the stage lacks is
    reported as such a stage's pools report it."""
    factors = dict(report.factors)
    if factors.get("draft") is not None:
        raise ValueError("pdstate's SGLang backend moves no draft model's KV from a pipeline-parallel prefill")
    ratios = list(factors["compression_ratios"])[cut.start : cut.end]
    c4_ring = factors["c4_ring"]
    if isinstance(c4_ring, dict) and 4 not in ratios:
        c4_ring = c4_ring["ring"]
    comps = [
        [kind, len(idx), _pick(list(items), idx)]
        for (kind, _, items), idx in zip(factors["components"], cut.components)
    ]
    update = {
        "compression_ratios": ratios,
        "stage": [cut.start, cut.end],
        "c4_ring": c4_ring,
        "c128_ring": factors["c128_ring"] if 128 in ratios else None,
        "main_kv_item_lens": _pick(list(factors["main_kv_item_lens"]), cut.main),
        "components": comps,
    }
    sliced = tuple((name, update.get(name, value)) for name, value in report.factors)
    return report.model_copy(
        update={"factors": sliced, "fingerprint": fingerprint(report.page_size, report.kv_dtype, sliced)}
    )
