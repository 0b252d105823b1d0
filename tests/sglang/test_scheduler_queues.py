"""Requests through SGLang's own scheduler queues, two processes, every byte checked (``devtools.sglang_queues``).

The path a real scheduler takes, which ``test_pair.py`` (managers called directly) does not cover:
on the prefill, ``PrefillBootstrapQueue`` (``add``, ``pop_bootstrapped``; it builds the manager
from the pools itself), ``send_kv_chunk`` (a non-last chunk, then the last with the state) and
``process_disagg_prefill_inflight_queue``; on the decode, ``process_decode_queue`` over
``DecodePreallocQueue`` and ``DecodeTransferQueue``. Per release (0.5.19 and 0.5.23, each from its
cached environment) one prefill child and one decode child run (``queue_pair``, shared with
``test_rank_endpoints.py`` and the bench's rank endpoints): with SGLang's own Mooncake backend
and with backend ``pdstate``, a same-config pair ends Success on both sides with every landed
byte right (main KV, SWA window of target and draft, C4/C128 state, aux); with ``pdstate``, a
speculative-vs-not pair and a swapped C4/C128 order end Failed on both sides, naming the
factor, at once (``FAIL_FAST_S``), with no byte of the decode's memory written. SGLang's own backend on
the same two mismatches is recorded too: the byte check sees the wrong bytes it lands.

SGLang's own request-lifecycle features, every byte of the decode checked, with backend
``pdstate`` through the same children on both releases, and with SGLang's Mooncake backend (the
control: what upstream does beside pdstate, in children of its own) on 0.5.23 alone, the release
with every feature below; the one difference between the releases asserted here (0.5.23's deferred
release of an aborted request) is asserted with ``pdstate`` on both:
- an abort of a transfer-queue request (as the scheduler's ``abort_request`` does) while the
  prefill is still in its forward: the decode fails with "Aborted by AbortReq.", its pages are
  released at once (``RELEASE_S``; 0.5.23: held for its deferred release, then released on the
  acknowledgement recorded as the fence held), and nothing lands, even when the prefill sends later;
- no byte after release (``pdstate``): a decode stopped (SIGSTOP, the whole process) past SGLang's
  waiting timeout and the prefill's peer timeout while the prefill's copy into it is held, then
  continued: the copy lands, the request fails, and from the moment the queues release its pages
  (0.5.19: at Failed, which waits for the prefill's confirmation; 0.5.23: its deferred release, on
  the acknowledgement recorded once fenced) not one byte of the decode's memory changes; the same
  with the prefill stopped while its copy is in flight, past the waiting timeout and the abort's
  fence: the copy lands after the receiver failed, before the release (0.5.19: the Failed waits
  for the prefill's confirmation, not just the fence's 5 s);
- SGLang's waiting timeout (``SGLANG_DISAGGREGATION_WAITING_TIMEOUT=3``) fails a request whose
  prefill is stuck at 3.0 s with SGLang's text, and its bootstrap timeout
  (``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=2``) a prefill request no decode asks for at 2.0 s;
- a room sent again after its first attempt ended, aborted or succeeded (what a retracted request's
  rebootstrap does over the same room): fresh pages, byte-exact; SGLang's rebootstrap resolves the
  prefill's HTTP address (``submit_prefill_recompute``'s ``/generate`` target) with either backend;
- 0.5.23's decode radix cache (SGLang's own tree and prefix match in the prealloc queue): a turn of
  1,024 tokens cached, the next turn of 1,100 tokens gets ``decode_prefix_len=768`` and names only
  the pages past it; the decode's whole row ends byte-exact, and fewer bytes move than in a full
  transfer of the same turn; on the paged layout and on the unified KV layout (the SWA window in
  each request slot's ring, ``SWA_RING``, moved whole).
"""

from __future__ import annotations

import re

import pytest

from pdstate.devtools.sglang_pair import table
from pdstate.devtools.sglang_pair.cases import CASES
from tests.sglang import runner
from tests.sglang.queue_cases import (
    BOOTSTRAP_TIMEOUT_S,
    FAIL_FAST_QUIET_S,
    FAIL_FAST_S,
    MOONCAKE_LIFECYCLE,
    MOONCAKE_REFUSES,
    PREFILL_STALL_S,
    REFUSED,
    RELEASE_QUIET_S,
    RELEASE_S,
    STALL_S,
    SUFFIX_TOKENS,
    TIMEOUT_LATE_QUIET_S,
    TIMEOUT_LATE_S,
    WAITING_TIMEOUT_S,
)
from tests.support.bounds import within


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
    within("a refusal ending both sides (queues)", r["elapsed_s"], FAIL_FAST_S, FAIL_FAST_QUIET_S)


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


def _control(release: str, backend: str) -> None:
    if backend == "mooncake" and release != MOONCAKE_LIFECYCLE:
        pytest.skip(f"SGLang's Mooncake backend through the lifecycle is the control, run on {MOONCAKE_LIFECYCLE}")


def _feature(queue_runs, backend: str, name: str) -> tuple[str, dict]:
    release, results = queue_runs
    _control(release, backend)
    runs = results[(backend, "features")]
    assert "setup_error" not in runs, f"{release}: {runs['setup_error']}\n{runs.get('setup_trace')}"
    return release, runs[name]


def _byte_exact(r: dict) -> None:
    pre, dec = r["prefill"], r["decode"]
    assert pre["outcome"] == dec["outcome"] == "Success", (pre, dec)
    assert dec["placed"] and dec["wrong_items"] == 0 and dec["outside_bytes"] == 0, dec
    assert dec["items"] > 250 and dec["changed_bytes"] > 10**7


@pytest.mark.parametrize("backend", ["pdstate", "mooncake"])
def test_abort_fences_and_releases_the_pages_at_once(queue_runs, backend):
    release, r = _feature(queue_runs, backend, "abort")
    pre, dec = r["prefill"], r["decode"]
    assert dec["outcome"] == "Failed" and dec["failure"].endswith("Aborted by AbortReq."), dec
    assert pre["outcome"] == "Failed", pre  # its chunks, sent after the abort, go nowhere
    assert dec["changed_bytes"] == 0 and dec["outside_bytes"] == 0, dec  # not one byte landed
    assert not dec["placed"]
    assert dec["released_ms"] is not None, dec
    within(f"an abort's pages released ({backend})", dec["released_ms"] / 1000, RELEASE_S, RELEASE_QUIET_S)
    # 0.5.23 (``deferred_kv_release``) defers the release until every prefill rank acknowledged the abort (both backends do it);
    # pdstate's acknowledgement is recorded as its fence holds, so the hold ends at the next poll
    assert dec["deferred"] == runner.row(release).deferred_kv_release, dec
    if backend == "pdstate":
        assert "aborted by decode: Aborted by AbortReq." in pre["failure"], pre
        within("an abort's call (the fence itself)", dec["abort_call_ms"] / 1000, RELEASE_S, RELEASE_QUIET_S)


def test_no_byte_lands_after_a_stalled_decode_releases_the_pages(queue_runs):
    release, r = _feature(queue_runs, "pdstate", "stalled")
    pre, dec = r["prefill"], r["decode"]
    # stopped past SGLang's waiting timeout and the prefill's peer timeout, the prefill's copy held
    assert dec["resumed_s"] - dec["stalled_s"] >= STALL_S, dec
    assert pre["outcome"] == "Failed" and "missed heartbeats" in pre["failure"], pre
    assert dec["outcome"] == "Failed" and dec["failure"], dec
    assert dec["released_ms"] is not None and dec["released_s"] >= dec["resumed_s"], dec  # pages released
    assert dec["after_release_bytes"] == 0, dec  # not one byte changed after the release
    assert dec["held_bytes"] > 10**6, dec  # the held copy landed once the decode went on, before that
    assert dec["deferred"] == runner.row(release).deferred_kv_release, dec


def test_no_byte_lands_after_release_when_the_prefill_stalls_past_the_abort_fence(queue_runs):
    release, r = _feature(queue_runs, "pdstate", "prefill_stalled")
    pre, dec = r["prefill"], r["decode"]
    assert pre["stalled_s"] >= PREFILL_STALL_S, pre  # stopped with its copy submitted
    # SGLang's text names the time it found waited: the decode, stopped past its waiting timeout,
    # finds it when it goes on (3.0 s at the earliest)
    want = re.search(rf"Request {r['room']} timed out after (\d+\.\d)s in KVPoll\.WaitingForInput$", dec["failure"])
    assert dec["outcome"] == "Failed" and want and float(want[1]) >= WAITING_TIMEOUT_S, dec
    assert pre["outcome"] == "Failed" and f"aborted by decode: {want[0]}" in pre["failure"], pre
    assert dec["released_ms"] is not None, dec  # the pages released within the deadline
    assert dec["after_release_bytes"] == 0, dec  # not one byte changed after the release
    # the prefill's copy was still in flight when the receiver failed: it landed once the prefill
    # went on, and only then were the pages released
    assert dec.get("concluded_to_release_bytes", 0) > 10**6, dec
    assert dec["deferred"] == runner.row(release).deferred_kv_release, dec


@pytest.mark.parametrize("backend", ["pdstate", "mooncake"])
def test_a_room_sent_again_after_an_abort_is_byte_exact(queue_runs, backend):
    _, r = _feature(queue_runs, backend, "resent_after_abort")
    _byte_exact(r)


@pytest.mark.parametrize("backend", ["pdstate", "mooncake"])
def test_a_room_sent_again_after_success_is_byte_exact(queue_runs, backend):
    """A retracted request's rebootstrap: the same room, a new receiver on fresh pages, a new sender."""
    _, first = _feature(queue_runs, backend, "first_attempt")
    _, second = _feature(queue_runs, backend, "second_attempt")
    _byte_exact(first)
    _byte_exact(second)
    assert second["room"] == first["room"]


@pytest.mark.parametrize("backend", ["pdstate", "mooncake"])
def test_rebootstrap_posts_the_recompute_to_the_prefill(queue_runs, backend):
    """SGLang's ``submit_prefill_recompute`` POSTs ``/generate`` where the prefill registered its
    HTTP port (SGLang's own registration and lookup, with either backend): the room, the prompt and
    the token already emitted, one new token."""
    _, r = _feature(queue_runs, backend, "first_attempt")
    _, post = _feature(queue_runs, backend, "rebootstrap_post")
    assert post is not None, r["decode"]
    assert post["path"] == "/generate" and post["json"]["bootstrap_room"] == r["room"], post
    assert len(post["json"]["input_ids"]) == r["tokens"] + 1  # the prompt and the token it emitted
    assert post["json"]["sampling_params"]["max_new_tokens"] == 1
    assert r["decode"]["rebootstrap_url"].startswith("http://127.0.0.1:"), r["decode"]


@pytest.mark.parametrize("backend", ["pdstate", "mooncake"])
def test_waiting_timeout_fails_a_stuck_request_at_the_configured_time(queue_runs, backend):
    _, r = _feature(queue_runs, backend, "waiting_timeout")
    pre, dec = r["prefill"], r["decode"]
    want = f"Request {r['room']} timed out after {WAITING_TIMEOUT_S:.1f}s in KVPoll.WaitingForInput"
    assert dec["outcome"] == "Failed" and dec["failure"].endswith(want), dec
    waited = dec["failed_s"] - dec["named_s"]
    assert WAITING_TIMEOUT_S - 0.05 <= waited, dec
    within("SGLang's waiting timeout, past its time", waited - WAITING_TIMEOUT_S, TIMEOUT_LATE_S, TIMEOUT_LATE_QUIET_S)
    assert dec["changed_bytes"] == 0 and not dec["placed"], dec  # released, nothing landed
    assert pre["outcome"] == "Failed", pre  # the stuck prefill's late send goes nowhere
    if backend == "pdstate":
        assert f"aborted by decode: {want}" in pre["failure"], pre


@pytest.mark.parametrize("backend", ["pdstate", "mooncake"])
def test_bootstrap_timeout_fails_a_prefill_request_no_decode_asks_for(queue_runs, backend):
    _, r = _feature(queue_runs, backend, "bootstrap_timeout")
    pre = r["prefill"]
    assert pre["outcome"] == "Failed" and pre["trace"] == ["add", "bootstrap failed"], pre
    assert f"Request {r['room']} timed out after {BOOTSTRAP_TIMEOUT_S:.1f}s in KVPoll.Bootstrapping" in pre["failure"]
    assert BOOTSTRAP_TIMEOUT_S <= r["elapsed_s"], r
    late = r["elapsed_s"] - BOOTSTRAP_TIMEOUT_S
    within("SGLang's bootstrap timeout, past its time", late, TIMEOUT_LATE_S, TIMEOUT_LATE_QUIET_S)


def _prefix_runs(queue_runs, backend: str, key: str) -> tuple[dict, dict, dict]:
    release, results = queue_runs
    if not runner.row(release).speculative_radix_cache:
        pytest.skip(f"SGLang {release} refuses DeepSeek-V4 with a decode radix cache at launch, for every backend")
    runs = results[(backend, key)]
    assert "setup_error" not in runs, f"{runs['setup_error']}\n{runs.get('setup_trace')}"
    first, nxt, full = runs["first"], runs["next"], runs["full"]
    for r in (first, nxt, full):
        assert r["prefill"]["outcome"] == r["decode"]["outcome"] == "Success", r
        assert r["decode"]["wrong_items"] == 0, r["decode"]
    assert first["decode"]["decode_prefix_len"] == full["decode"]["decode_prefix_len"] == 0
    prefix = nxt["decode"]["decode_prefix_len"]
    assert 0 < prefix < SUFFIX_TOKENS and prefix % 256 == 0, nxt["decode"]  # page-aligned, SGLang's own match
    assert nxt["decode"]["named_pages"] == full["decode"]["named_pages"] - prefix // 256
    assert nxt["decode"]["items"] == full["decode"]["items"]  # the whole row checked, prefix pages included
    assert 0 < nxt["prefill"]["bytes"] < full["prefill"]["bytes"], (nxt["prefill"], full["prefill"])
    return first, nxt, full


@pytest.mark.parametrize("backend", ["pdstate", "mooncake"])
def test_a_decode_prefix_hit_on_unified_kv_moves_the_suffix_and_the_whole_ring(queue_runs, backend):
    """Unified KV (0.5.23, DeepSeek-V4's layout for a decode radix cache): after a prefix hit the
    request slot's SWA ring (every window position, target and draft) and request state are checked
    item by item beside the main KV; only main-KV pages past the prefix move. SGLang names the SWA
    component (C4 states) as the padding page on both sides there: pdstate moves nothing of it."""
    _, nxt, full = _prefix_runs(queue_runs, backend, "prefix_unified")
    ring = nxt["decode"]["items_by"].get("swa_ring", 0)
    assert ring == full["decode"]["items_by"].get("swa_ring") > 0, (nxt["decode"], full["decode"])
    assert nxt["decode"]["items_by"] == full["decode"]["items_by"]
    assert nxt["decode"]["wrong_by"] == full["decode"]["wrong_by"] == dict.fromkeys(full["decode"]["wrong_by"], 0)
    if backend == "pdstate":  # SGLang's own backend also copies the SWA component's padding page
        assert full["decode"]["outside_bytes"] == 0, full["decode"]


@pytest.mark.parametrize("backend", ["pdstate", "mooncake"])
def test_a_decode_prefix_hit_moves_only_the_suffix_byte_exact(queue_runs, backend):
    """The decode's full row after a prefix hit holds what a full transfer lands (every item of the
    request, prefix pages included, checked); only the pages past the prefix moved, and the SWA
    window, request state, draft and aux whole (fewer bytes counted than the full transfer)."""
    _prefix_runs(queue_runs, backend, "prefix")
