"""``agent.common.end_io_thread_as_a_crash``: the fault-injection seam that ends an agent's I/O
thread without the orderly close (what ``tests/sglang/adapter_probe.py`` drives through SGLang)."""

from __future__ import annotations

import pytest

from pdstate.agent.common import end_io_thread_as_a_crash
from pdstate.errors import AgentClosed
from tests.agent.support import loopback_agents, make_side

pytestmark = pytest.mark.timeout(60)


def test_the_thread_dies_without_the_close_and_close_still_closes():
    with loopback_agents(make_side(False), make_side(True)) as (pa, da):
        assert pa.alive and not pa.closed
        assert end_io_thread_as_a_crash(pa) is True
        assert not pa.alive and not pa.closed  # died: neither running nor closed
        with pytest.raises(AgentClosed, match=r"^the agent is closed$"):
            pa.sender(32, 2, aux_index=0)  # nothing runs on a dead thread
        assert da.alive  # the other agent is untouched
        pa.close()
        assert pa.closed and not pa.alive
