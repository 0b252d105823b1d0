"""A PP prefill stage facing a decode of the whole model (``protocol.stages``): the decode's view of
itself sliced to the stage's layers reports and lists exactly what a pool of only those layers does.

The oracle is pdstate's own DeepSeek-V4 pools built as a PP stage (``start_layer``/``layer_num``,
upstream's ``start_layer``/``end_layer``): the sliced report's every factor and fingerprint, and the
sliced item lengths of every list, equal the stage pool's. That the sliced pointers are the
stage's layers' is shown byte for byte through SGLang's own queues
(``tests/sglang/test_scheduler_queues_topologies.py``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdstate.pools.presets import PoolSettings, build_worker_pools
from pdstate.pools.reporting import build_report
from pdstate.protocol.report import diff
from pdstate.protocol.stages import stage_report, stage_slice, stage_view

FLASH = (0, 0) + (4, 128) * 20 + (4,)  # DeepSeek-V4-Flash's 43 layers
STAGES = [(0, 21), (21, 43), (5, 30), (0, 4), (41, 43)]


def _side(settings: PoolSettings):
    pools = build_worker_pools(settings)
    report, kv_args = build_report(pools.target, pools.draft)
    return report, kv_args


def _cut(kv_args, start: int, end: int, ratios=FLASH):
    components = list(zip(kv_args.state_types, (len(p) for p in kv_args.state_data_ptrs)))
    return stage_slice(ratios, start, end, len(kv_args.kv_data_ptrs), components)


@pytest.mark.parametrize("unified", [False, True], ids=["paged", "unified"])
@pytest.mark.parametrize("start, end", STAGES)
def test_the_sliced_decode_reports_and_lists_what_the_stage_does(unified, start, end):
    whole = PoolSettings(
        compression_ratios=FLASH, layer_num=len(FLASH), draft_enabled=False, unified_kv=unified, full_tokens=2048
    )
    report, kv_args = _side(whole)
    stage_rep, stage_args = _side(replace(whole, start_layer=start, layer_num=end - start))
    cut = _cut(kv_args, start, end)
    sliced = stage_report(report, cut)
    assert diff(sliced, stage_rep) == []
    assert sliced.fingerprint == stage_rep.fingerprint != report.fingerprint
    view = stage_view(kv_args, cut)
    assert view.kv_item_lens == stage_args.kv_item_lens
    assert view.kv_data_lens == stage_args.kv_data_lens
    assert view.state_item_lens == stage_args.state_item_lens
    assert view.state_data_lens == stage_args.state_data_lens
    assert [len(p) for p in view.state_data_ptrs] == [len(p) for p in stage_args.state_data_ptrs]
    assert set(view.kv_data_ptrs) <= set(kv_args.kv_data_ptrs)  # the decode's own buffers, a subset
    assert view.aux_data_ptrs == kv_args.aux_data_ptrs  # every stage sends the request's aux row
    assert (view.prefill_start_layer, view.prefill_end_layer) == (start, end)


def test_the_groups_are_cut_per_ratio_as_sglang_lists_them():
    """Main KV ``[C4 | C4 indexer | C128]``, the SWA component ``[SWA | C4 state | C4 indexer state]``,
    the C128 state by C128 layer: stage [2, 6) of layers 0 0 4 128 4 128 ... holds C4 layers 2, 4
    (entries 0, 1 of 21) and C128 layers 3, 5 (entries 0, 1 of 20)."""
    _, kv_args = _side(PoolSettings(compression_ratios=FLASH, layer_num=len(FLASH), draft_enabled=False))
    cut = _cut(kv_args, 2, 6)
    assert cut.main == (0, 1, 21, 22, 42, 43)
    swa, c128 = cut.components
    assert swa == (2, 3, 4, 5, 43, 44, 64, 65)
    assert c128 == (0, 1)


def test_a_draft_or_a_stage_off_the_model_has_no_slice():
    _, kv_args = _side(PoolSettings(compression_ratios=FLASH, layer_num=len(FLASH)))  # a NextN draft: its SWA
    with pytest.raises(ValueError, match=r"state component 'swa' \(1 buffers\) has no PP stage slice"):
        _cut(kv_args, 0, 21)
    with pytest.raises(ValueError, match=r"registers 65 main-KV buffers, not the target's 62 \(a draft model's KV\)"):
        stage_slice(FLASH, 0, 21, 65, [])
    with pytest.raises(ValueError, match=r"PP stage \[21, 44\) is not a slice of the decode's 43 layers"):
        _cut(kv_args, 21, 44)
    _, plain = _side(PoolSettings(compression_ratios=FLASH, layer_num=len(FLASH), draft_enabled=False))
    with pytest.raises(
        ValueError, match=r"PP stage \[0, 3\) has no layer of the decode's state components \['c128_state'\]"
    ):
        _cut(plain, 0, 3)
    report, _ = _side(PoolSettings(compression_ratios=FLASH, layer_num=len(FLASH)))
    with pytest.raises(ValueError, match="moves no draft model's KV from a pipeline-parallel prefill"):
        stage_report(report, _cut(plain, 0, 21))
