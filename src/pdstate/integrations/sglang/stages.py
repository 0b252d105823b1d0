"""A decode of one stage fed by a pipeline-parallel prefill: one agent per prefill stage.

SGLang maps a decode of one PP stage to every stage of a PP prefill (``target_pp_ranks`` = all of
them, ``required_prefill_response_num`` times their number), and each stage sends its own layers.
The decode's agent reports and registers the whole model; the agent facing stage ``k`` reports and
registers that stage's slice of it (``protocol.stages``: SGLang's ``_mla_slice_ptrs_for_pp``
groups), over the same memory. The stage's layers are SGLang's own partition
(``get_pp_indices``, ``SGLANG_PP_LAYER_PARTITION`` honoured as the prefill honours it); a stage that
holds other layers is refused at its handshake, naming ``stage``. Built on first use, kept for the
manager's life.
"""

from __future__ import annotations

import threading

from pdstate.agent import DecodeAgent
from pdstate.protocol.stages import stage_report, stage_slice, stage_view

__all__ = ["MAX_STAGE_AGENTS", "StageAgents", "stage_layers"]

# stage agents one decode rank builds at most (each an I/O thread, sockets and an engine
# registration): the pairs (rank, size) come from what prefills' bootstrap servers say, so a buggy
# or hostile one must not make a decode build one per claim
MAX_STAGE_AGENTS = 64


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """``[start, end)`` of stage ``pp_rank`` of ``pp_size``, as SGLang partitions a model's layers."""
    from sglang.srt.distributed.utils import get_pp_indices

    start, end = get_pp_indices(num_layers, pp_rank, pp_size)
    return int(start), int(end)


class StageAgents:
    """The decode agents of one decode rank facing the stages of PP prefills, by ``(rank, size)``."""

    def __init__(self, kv_args, report, worker_id: str, agent_kwargs: dict) -> None:
        self.kv_args, self.report, self.worker_id, self.kwargs = kv_args, report, worker_id, agent_kwargs
        self._agents: dict[tuple[int, int], DecodeAgent] = {}
        self._lock = threading.Lock()

    def agent(self, pp_rank: int, pp_size: int) -> DecodeAgent:
        """The agent facing stage ``pp_rank`` of ``pp_size`` (``ValueError``: no such slice here)."""
        key = (int(pp_rank), int(pp_size))
        if not 0 <= key[0] < key[1]:
            raise ValueError(f"a prefill stage {key[0]} of {key[1]} does not exist")
        with self._lock:
            agent = self._agents.get(key)
            if agent is None:
                if len(self._agents) >= MAX_STAGE_AGENTS:
                    raise ValueError(
                        f"this decode rank already faces {MAX_STAGE_AGENTS} prefill stages (stages.MAX_STAGE_AGENTS): "
                        f"stage {key[0]} of {key[1]} refused"
                    )
                agent = self._agents[key] = self._build(*key)
            return agent

    def _build(self, pp_rank: int, pp_size: int) -> DecodeAgent:
        start, end = self.report.factor("stage")
        if start != 0:
            raise ValueError(f"this decode holds layers [{start}, {end}), not the whole model")
        args = self.kv_args
        components = list(zip(args.state_types, (len(p) for p in args.state_data_ptrs)))
        ratios = self.report.factor("compression_ratios")
        layers = int(getattr(args, "total_kv_layers", None) or end)  # SGLang's num_hidden_layers where it says
        cut = stage_slice(ratios, *stage_layers(layers, pp_rank, pp_size), len(args.kv_data_ptrs), components)
        kwargs = {**self.kwargs, "report": stage_report(self.report, cut)}
        return DecodeAgent(stage_view(args, cut), worker_id=f"{self.worker_id}-stage{pp_rank}of{pp_size}", **kwargs)

    def close(self) -> None:
        with self._lock:
            agents, self._agents = list(self._agents.values()), {}
        for agent in agents:
            agent.close()
