"""Requests through SGLang's own scheduler queues, two processes, every byte checked (``devtools.sglang_queues``).

The path a real scheduler takes, which ``test_pair.py`` (managers called directly) does not cover:
on the prefill, ``PrefillBootstrapQueue`` (``add``, ``pop_bootstrapped``; it builds the manager
from the pools itself), ``send_kv_chunk`` (a non-last chunk, then the last with the state) and
``process_disagg_prefill_inflight_queue``; on the decode, ``process_decode_queue`` over
``DecodePreallocQueue`` and ``DecodeTransferQueue``. Per release (0.5.19 and 0.5.23, each from its
cached environment) one prefill child and one decode child run: with SGLang's own Mooncake backend
and with backend ``pdstate``, a same-config pair ends Success on both sides with every landed
byte right (main KV, SWA window of target and draft, C4/C128 state, aux); with ``pdstate``, a
speculative-vs-not pair and a swapped C4/C128 order end Failed on both sides, naming the
factor, in under a second, with no byte of the decode's memory written. SGLang's own backend on
the same two mismatches is recorded too: the byte check sees the wrong bytes it lands.
"""

from __future__ import annotations

import pytest

from pdstate.devtools.sglang_pair import table
from pdstate.devtools.sglang_pair.cases import CASES
from tests.sglang import runner

DEADLINE_S = 3.0  # per side and request: what bounds a hang
FAIL_FAST_S = 1.0
REFUSED = ("spec_vs_nospec", "c4_c128_order")
RUNS = [("mooncake", "correct"), ("pdstate", "correct")] + [
    (b, name) for b in ("pdstate", "mooncake") for name in REFUSED
]
# What SGLang's own Mooncake backend does with them through its queues (as with the managers
# called directly, ../shared/reference/sglang_cpu.md): Success with wrong bytes, except that 0.5.23
# refuses speculative vs not itself.
MOONCAKE_REFUSES = {("0.5.23", "spec_vs_nospec")}


@pytest.fixture(scope="module", params=runner.RELEASES, ids=lambda r: f"sglang-{r}")
def queue_runs(request) -> tuple[str, dict]:
    """``(release, {(backend, case): result})``: one pair of children per release, every run in it."""
    from pdstate.devtools.sglang_pair.pair import PDSTATE_ENGINE_ENV, mooncake_missing
    from pdstate.devtools.sglang_queues.pair import QueuePair

    release = request.param
    try:
        target = runner.ensure_env(release)
    except runner.EnvUnavailable as exc:
        runner.skip(exc)
    if why := mooncake_missing():
        pytest.skip(why)
    with QueuePair(target, extra_env=PDSTATE_ENGINE_ENV) as pair:
        results = {(b, name): pair.run_case(CASES[name], b, deadline_s=DEADLINE_S) for b, name in RUNS}
    return release, results


def _only(queue_runs, backend: str, name: str) -> dict:
    release, results = queue_runs
    result = results[(backend, name)]
    assert "setup_error" not in result, f"{release}: {result['setup_error']}\n{result.get('setup_trace')}"
    assert len(result["requests"]) == 1
    return result["requests"][0]


@pytest.mark.parametrize("backend", ["mooncake", "pdstate"])
def test_correct_pair_through_the_queues_is_byte_exact(queue_runs, backend):
    r = _only(queue_runs, backend, "correct")
    pre, dec = r["prefill"], r["decode"]
    assert pre["outcome"] == dec["outcome"] == "Success", (pre, dec)
    assert pre["trace"] == ["add", "bootstrapped", "chunk", "last chunk", "inflight done"]
    assert dec["placed"]  # pre-allocated by DecodePreallocQueue, still held by the request
    assert dec["wrong_items"] == 0 and dec["outside_bytes"] == 0, dec
    assert dec["items"] > 250 and dec["aux_items"] >= 10  # main KV, SWA, C4/C128 state, draft; aux rows
    assert dec["bytes_checked"] > 10**8
    assert dec["changed_bytes"] > 10**7  # the request's items, all of them right
    assert r["send_to_success_ms"] > 0


@pytest.mark.parametrize("name", REFUSED)
def test_pdstate_refuses_a_mismatch_through_the_queues(queue_runs, name):
    r = _only(queue_runs, "pdstate", name)
    pre, dec = r["prefill"], r["decode"]
    assert pre["outcome"] == dec["outcome"] == "Failed", (pre, dec)
    assert pre["trace"] == ["add", "bootstrap failed"]  # no forward, no chunk sent
    factor = CASES[name].factor
    assert table.factor_of(pre["failure"]) == factor, pre["failure"]
    assert table.factor_of(dec["failure"]) == factor, dec["failure"]
    assert not dec["placed"] and dec["changed_bytes"] == 0  # not one byte of the decode's memory written
    assert r["elapsed_s"] < FAIL_FAST_S


@pytest.mark.parametrize("name", REFUSED)
def test_sglang_mooncake_alone_on_a_mismatch_through_the_queues(queue_runs, name):
    release = queue_runs[0]
    r = _only(queue_runs, "mooncake", name)
    pre, dec = r["prefill"], r["decode"]
    if (release, name) in MOONCAKE_REFUSES:
        assert pre["outcome"] == dec["outcome"] == "Failed", (pre, dec)
        assert dec["changed_bytes"] == 0
    else:
        assert pre["outcome"] == dec["outcome"] == "Success", (pre, dec)
        assert dec["wrong_items"] > 0  # landed, in the wrong places: only the byte check tells
