"""``integrations.sglang.stages.StageAgents`` bounds the agents one decode rank builds for the PP
prefills it faces: the (stage, size) pairs come from the prefills' bootstrap answers, so a buggy
or hostile prefill claiming ever new stages is refused past ``MAX_STAGE_AGENTS``, with one line
(no SGLang here: the agents are stand-ins, the bound is the class's own)."""

from __future__ import annotations

import pytest

from pdstate.integrations.sglang import stages


class _Agent:
    closed = False

    def close(self) -> None:
        self.closed = True


class CountingStages(stages.StageAgents):
    """``StageAgents`` whose agents are stand-ins, counted as they are built."""

    def __init__(self) -> None:
        super().__init__(None, None, "decode-0", {})
        self.built: list[tuple[int, int]] = []

    def _build(self, pp_rank: int, pp_size: int) -> _Agent:
        self.built.append((pp_rank, pp_size))
        return _Agent()


def test_new_stages_past_the_bound_are_refused_and_known_ones_still_served(monkeypatch):
    monkeypatch.setattr(stages, "MAX_STAGE_AGENTS", 4)
    s = CountingStages()
    first = [s.agent(r, 4) for r in range(4)]
    with pytest.raises(
        ValueError,
        match=r"^this decode rank already faces 4 prefill stages \(stages\.MAX_STAGE_AGENTS\): stage 0 of 9 refused$",
    ):
        s.agent(0, 9)  # a claim of another partition: would be a fifth agent
    assert [s.agent(r, 4) for r in range(4)] == first  # the known ones: the same agents, none built again
    assert s.built == [(0, 4), (1, 4), (2, 4), (3, 4)]
    s.close()
    assert all(a.closed for a in first)


@pytest.mark.parametrize(("rank", "size"), [(4, 4), (-1, 2), (0, 0)])
def test_a_stage_outside_its_size_is_refused_without_an_agent(rank, size):
    s = CountingStages()
    with pytest.raises(ValueError, match=rf"^a prefill stage {rank} of {size} does not exist$"):
        s.agent(rank, size)
    assert s.built == []
