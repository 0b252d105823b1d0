"""Unlike topologies through SGLang's own scheduler queues (``devtools.sglang_queues``), every byte checked.

A decode of attention TP 2 fed by a prefill of TP 1: one prefill child and two decode children
(attention-TP ranks 0 and 1 of one decode, each its own process with its own pools), on both
releases, with SGLang's own Mooncake backend and with backend ``pdstate``. SGLang maps both decode
ranks to prefill rank 0 (``required_dst_info_num`` 2: DeepSeek-V4's KV is replicated across
attention-TP ranks); the prefill rank sends the whole request to each. Both decode ranks end
Success with every item of every kind moved (main KV, each ``StateType``, aux) equal to the
prefill's and nothing written elsewhere; pdstate moves the request's bytes once per decode rank.
Then both decode ranks abort a request while the prefill computes it (each fails and releases its
pages at once, nothing lands), and the same room is sent again, byte-exact on both ranks.

A prefill of two PP stages feeding a decode of one: two prefill children (stages 0 and 1 of one
prefill, each with the pools of its layers as SGLang partitions the 43, stage 0 running the
bootstrap server) and one decode child, no draft model, on both releases and both backends. The
decode's receiver takes the request from both stages (SGLang: ``target_pp_ranks`` [0, 1]); every
item of every kind lands equal to the stage that holds its layer, nothing elsewhere. What stays
refused of PP (a decode of several stages, a stage with a draft) is refused at start
(``tests/sglang/test_adapter.py``, ``launch.backend.pipeline_parallel_refusal``).
"""

from __future__ import annotations

import pytest

from pdstate.devtools.sglang_pair.cases import CASES, NO_DRAFT
from tests.sglang import runner
from tests.sglang.queue_cases import RELEASE_QUIET_S, RELEASE_S
from tests.support.bounds import within

DEADLINE_S = 3.0
BACKENDS = ("mooncake", "pdstate")
KINDS = {"main", "aux"}  # besides every StateType of the release's KVArgs


@pytest.fixture(scope="module", params=runner.RELEASES, ids=lambda r: f"sglang-{r}")
def tp_runs(request) -> tuple[str, dict]:
    """``(release, {backend: result})``: one set of children (a prefill of attention TP 1, a decode
    of attention TP 2) for both backends in turn, the same-pools case, one request in two chunks."""
    from pdstate.devtools.sglang_pair.pair import PDSTATE_ENGINE_ENV
    from pdstate.devtools.sglang_queues.pair import QueuePair

    release = request.param
    target = runner.queue_env(release)
    results = {}
    with runner.closing_together(QueuePair(target, extra_env=PDSTATE_ENGINE_ENV, decode_ranks=2)) as pair:
        for backend in BACKENDS:  # SGLang's Mooncake first, in children that hold no managers yet
            results[backend] = r = pair.run_case(CASES["correct"], backend, deadline_s=DEADLINE_S)
            if "setup_error" not in r:  # both decode ranks abort (as each rank's scheduler does), then again
                n = CASES["correct"].tokens[0]
                abort = {"abort_after_s": 0.2, "settle_s": 1.2}
                r["abort"] = pair.request(n, DEADLINE_S, prefill={"hold_s": 1.0}, decode=abort)
                r["resent"] = pair.request(n, DEADLINE_S, room=r["abort"]["room"])
    return release, results


@pytest.fixture(scope="module", params=runner.RELEASES, ids=lambda r: f"sglang-{r}")
def pp_runs(request) -> tuple[str, dict]:
    """``(release, {backend: result})``: one set of children (a prefill of two PP stages, a decode
    of one) for both backends in turn, pools without a draft, one request in two chunks."""
    from pdstate.devtools.sglang_pair.pair import PDSTATE_ENGINE_ENV
    from pdstate.devtools.sglang_queues.pair import QueuePair

    release = request.param
    target = runner.queue_env(release)
    with runner.closing_together(QueuePair(target, extra_env=PDSTATE_ENGINE_ENV, prefill_stages=2)) as pair:
        return release, {backend: pair.run_case(NO_DRAFT, backend, deadline_s=DEADLINE_S) for backend in BACKENDS}


def _request(tp_runs, backend: str, name: str | None = None) -> dict:
    release, results = tp_runs
    result = results[backend]
    assert "setup_error" not in result, f"{release}: {result['setup_error']}\n{result.get('setup_trace')}"
    assert len(result["requests"]) == 1
    return result["requests"][0] if name is None else result[name]


@pytest.mark.parametrize("name", [None, "resent"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tp1_prefill_feeds_a_tp2_decode_byte_exact(tp_runs, backend, name):
    """The request, and the same room sent again after both decode ranks aborted it."""
    r = _request(tp_runs, backend, name)
    pre, ranks = r["prefill"], r["decode_ranks"]
    assert pre["outcome"] == "Success", pre
    assert pre["trace"] == ["add", "bootstrapped", "chunk", "last chunk", "inflight done"]
    assert len(ranks) == 2
    for dec in ranks:
        assert dec["outcome"] == "Success" and dec["placed"], dec
        assert dec["wrong_items"] == 0 and dec["outside_bytes"] == 0, dec
        assert set(dec["wrong_by"]) >= KINDS and len(dec["wrong_by"]) > len(KINDS), dec["wrong_by"]
        assert all(dec["items_by"][kind] > 0 for kind in dec["items_by"]), dec["items_by"]  # each kind moved
        assert dec["items"] > 250 and dec["aux_items"] >= 10
        assert dec["changed_bytes"] > 10**7
    assert ranks[0]["items_by"] == ranks[1]["items_by"]  # the same request, whole, on each rank


def test_pdstate_moves_the_request_once_per_decode_rank(tp_runs):
    """The prefill's transfer metric counts both copies: twice what a TP 1 decode takes."""
    r = _request(tp_runs, "pdstate")
    moved = r["prefill"]["bytes"]
    assert moved > 0 and moved % 2 == 0
    assert moved // 2 > 10**7  # each decode rank's copy: main KV, state, aux


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_abort_on_both_decode_ranks_fences_and_releases_at_once(tp_runs, backend):
    """Both decode ranks abort while the prefill is still in its forward: each fails with SGLang's
    text and releases its pages at once (``RELEASE_S``) (0.5.23: after the acknowledgement its deferred
    release waits for); the prefill's later send lands nowhere."""
    release = tp_runs[0]
    r = _request(tp_runs, backend, "abort")
    assert r["prefill"]["outcome"] == "Failed", r["prefill"]
    for dec in r["decode_ranks"]:
        assert dec["outcome"] == "Failed" and dec["failure"].endswith("Aborted by AbortReq."), dec
        assert dec["changed_bytes"] == 0 and dec["outside_bytes"] == 0 and not dec["placed"], dec
        assert dec["released_ms"] is not None, dec
        within(f"an abort's pages released (TP 2, {backend})", dec["released_ms"] / 1000, RELEASE_S, RELEASE_QUIET_S)
        assert dec["deferred"] == runner.row(release).deferred_kv_release, dec


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pp2_prefill_feeds_a_pp1_decode_byte_exact(pp_runs, backend):
    """Both stages send their layers (main KV, SWA and C4 state, C128 state) and the aux row; the
    decode of the whole model ends Success with every item equal and nothing written elsewhere."""
    r = _request(pp_runs, backend)
    stages, dec = r["prefill_stages"], r["decode"]
    assert len(stages) == 2
    for stage in stages:
        assert stage["outcome"] == "Success", stage
        assert stage["trace"] == ["add", "bootstrapped", "chunk", "last chunk", "inflight done"]
        assert stage["bytes"] > 10**6, stage  # each stage moved its own layers
    assert dec["outcome"] == "Success" and dec["placed"], dec
    assert dec["wrong_items"] == 0 and dec["outside_bytes"] == 0, dec
    assert set(dec["wrong_by"]) >= KINDS and len(dec["wrong_by"]) > len(KINDS), dec["wrong_by"]
    assert dec["items_by"] == {"main": 186, "swa": 85, "c128_state": 20}  # every layer's, from both stages
    assert dec["aux_items"] >= 10 and dec["changed_bytes"] > 10**7
    assert r["send_to_success_ms"] is not None


def test_pdstate_moves_each_stages_layers_once(pp_runs):
    """pdstate's stages move disjoint layer slices: stage 1 holds one layer more (22 of 43)."""
    stages = _request(pp_runs, "pdstate")["prefill_stages"]
    first, second = (stage["bytes"] for stage in stages)
    assert 10**6 < first < second
