"""The stand-in parallel context of a driver child: SGLang's process groups and ranks, per release.

Each child is one rank (an attention-TP rank of a wider decode, or a PP stage of a prefill),
polling alone over a gloo group of one; the context says the widths and this child's ranks.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from pdstate.devtools.sglang_pair import boot

NEW = boot.row().keyword_api  # 0.5.23's internals (``releases``)

RENDEZVOUS_S = 30.0
_HELD: list = []


def group_of(group, size: int = 1, rank: int = 0) -> SimpleNamespace:
    """A coordinator group (rank ``rank`` of ``size``) whose ``cpu_group`` is the gloo group of one."""
    return SimpleNamespace(cpu_group=group, device_group=group, world_size=size, rank_in_group=rank, rank=rank,
                           ranks=list(range(size)), is_first_rank=rank == 0, is_last_rank=rank == size - 1,
                           local_rank=rank)  # fmt: skip


class StageGroup(SimpleNamespace):
    """The PP group of a prefill whose stages are separate children: SGLang 0.5.23's consensus
    store broadcasts stage 0's address over it (``broadcast_object``), passed here through a file
    named by the case's bootstrap port (the stages are set up in order, stage 0 first)."""

    def broadcast_object(self, obj, src: int = 0):
        path = Path(tempfile.gettempdir()) / f"pdstate-queues-pp-{self.rendezvous}.json"
        if self.rank_in_group == src:
            staged = path.with_suffix(".tmp")
            staged.write_text(json.dumps(obj))
            staged.replace(path)
            return obj
        deadline = time.monotonic() + RENDEZVOUS_S
        while not path.exists():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"PP stage {self.rank_in_group}: stage {src} published nothing at {path}")
            time.sleep(0.01)
        return json.loads(path.read_text())


def parallel_context(
    group, attn_tp: tuple[int, int] = (1, 0), pp: tuple[int, int] = (1, 0), rendezvous: int = 0
) -> None:
    """cp = dp = 1, ``attn_tp = (size, rank)`` (tp the same) and ``pp = (size, rank)``; the queues
    all-reduce over ``group`` (a gloo group of one: each attention-TP rank of a wider decode, each
    stage of a PP prefill, is a process of its own, polling alone). Set once per process."""
    from sglang.srt.runtime_context import get_parallel

    size, rank = tuple(attn_tp)
    pp_size, pp_rank = tuple(pp)
    held = (size, rank, pp_size, pp_rank)
    if _HELD and _HELD[0] != held:
        raise RuntimeError(f"this child runs attention TP and PP {_HELD[0]}; a new child is needed for {held}")
    if NEW:  # 0.5.23: the queues read the groups and ranks from the parallel context
        if not _HELD:
            g, tp = group_of(group), group_of(group, size, rank)
            get_parallel().override_permanently(
                tp_size=size, tp_rank=rank, pp_size=pp_size, pp_rank=pp_rank, attn_tp_size=size, attn_tp_rank=rank,
                attn_cp_size=1, attn_cp_rank=0, attn_dp_size=1, attn_dp_rank=0, dp_size=1, dp_rank=0, dcp_size=1,
                dcp_rank=0, attn_dcp_size=1, attn_dcp_rank=0, moe_tp_size=size, moe_tp_rank=rank, tp_group=tp,
                pp_group=StageGroup(**vars(group_of(group, pp_size, pp_rank)), rendezvous=rendezvous),
                attn_tp_group=tp, attn_cp_group=g,
            )  # fmt: skip
            _HELD.append(held)
        return
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers import dp_attention

    if not _HELD:
        sizes = dict(world_size=size * pp_size, tp_size=size, pp_size=pp_size, attn_tp_size=size, attn_cp_size=1, dcp_size=1,
                     attn_dcp_size=1, attn_dp_size=1)  # fmt: skip
        ranks = dict(world_rank=pp_rank * size + rank, tp_rank=rank, pp_rank=pp_rank, attn_tp_rank=rank, attn_cp_rank=0, dcp_rank=0,
                     attn_dcp_rank=0, attn_dp_rank=0)  # fmt: skip
        context = get_parallel().override(**sizes, **ranks, dcp_enabled=False)
        context.__enter__()  # entered for the process's life (kept referenced: never exited)
        _HELD.extend((held, context))
    dp_attention._ATTN_DP_RANK, dp_attention._ATTN_DP_SIZE = 0, 1
    if parallel_state._PP is None:
        parallel_state._PP = SimpleNamespace(
            world_size=pp_size, rank_in_group=pp_rank, is_first_rank=pp_rank == 0, is_last_rank=pp_rank == pp_size - 1
        )
