"""A running request moves from one SGLang 0.5.23 decode to another through their scheduler queues
(``devtools.sglang_queues.migrate``, ``integrations.sglang.migrate``), every byte compared.

A request of 700 tokens arrives on decode A from the prefill through SGLang's queues (as
``test_scheduler_queues`` runs them, byte-checked), enters A's running batch and runs three
decode steps there (each takes its token's KV slot through the allocator's ``alloc_decode`` and
rewrites the token's page, SWA page and every request-state row: the C4 ring's and C128's).
Then it moves to decode B instead of being retracted for recompute: B's agent shakes hands with
A's source agent (a ``PrefillAgent`` over A's own memory); A pauses it and sends its rows and aux
row; B's own ``DecodePreallocQueue`` allocates its rows and its transfer queue commits it (its
last output token from the aux row) into B's running batch; A releases its rows; B runs a step.
Asserted: every item of the request (main-KV pages: C4 KV, C4 indexer, C128 KV; the SWA
window's pages of target and draft with the C4 compressor and indexer state rows they hold on the
paged layout; the C128 state rows) holds on B the bytes it holds on A, nothing else of B's memory
was written, B's request has A's output tokens and decodes on, A's pages are back in its free
lists and not a byte of A's memory changes after the release. A target whose pages are 512
tokens is refused at the handshake on both sides, before anything is paused: the request stays
on A, whole, in its running batch.

The prefill and decode A are ``queue_pair``'s children (after ``queue_runs``, whose SGLang
Mooncake cases need them fresh); decode B is one more child. SGLang 0.5.19 is not supported
(``integrations.sglang.migrate.check_supported``): skipped.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdstate.devtools.sglang_pair.cases import BASE
from tests.sglang import runner

TOKENS, STEPS = 700, 3
UNLIKE = replace(BASE, page_size=512)


@pytest.fixture(scope="module")
def moves(sglang_release, request) -> dict:
    if not sglang_release.new_api:
        pytest.skip(f"moving a running request needs SGLang 0.5.23, not {sglang_release.version}")
    request.getfixturevalue("queue_runs")
    pair = request.getfixturevalue("queue_pair")
    from pdstate.devtools.sglang_pair.pair import PDSTATE_ENGINE_ENV
    from pdstate.devtools.sglang_queues.migrate import SLACK_S, MigrationTrio

    target = runner.queue_env(sglang_release.version)
    with MigrationTrio(target, extra_env=PDSTATE_ENGINE_ENV, prefill=pair.prefill, a=pair.decode) as trio:
        out = {"setup": trio.setup()}
        out["placed"] = placed = trio.place(TOKENS, STEPS, keep_digests=True)
        out["moved"] = trio.move(placed)
        trio.setup_target(UNLIKE)
        out["kept"] = kept = trio.place(TOKENS, STEPS)
        out["before"] = trio.a.call("digests", SLACK_S, room=kept["room"])
        out["refused"] = trio.move(kept)
        out["after"] = trio.a.call("digests", SLACK_S, room=kept["room"])
        out["still_runs"] = trio.a.call("steps", SLACK_S, room=kept["room"], n=1)
    return out


def test_a_running_request_moves_to_another_decode_byte_for_byte(moves):
    placed, m = moves["placed"], moves["moved"]
    assert m["outcome"] == "Success", m
    assert m["source"]["outcome"] == "SUCCESS" and m["target"]["running"]
    # the decode steps on A advanced it: more output tokens, its state rows rewritten
    assert len(placed["output_ids"]) == len(placed["first_output_ids"]) + STEPS
    assert m["seq_len"] == TOKENS + STEPS
    arrived, moved = placed["arrived_items"], m["source_items"]
    state_rows = [k for k in arrived if k.startswith("('c128'")]
    assert state_rows and all(moved[k] != arrived[k] for k in state_rows)
    # every item of the request equal on B and A: main-KV pages (C4, indexer, C128), SWA window
    # pages of target and draft (with the C4 and indexer state rows), C128 state rows
    assert m["differing_items"] == []
    assert m["by_kind"]["kv"] >= 3 * 62 and m["by_kind"]["swa"] > 0 and m["by_kind"]["c128"] > 0, m["by_kind"]
    assert m["target_outside_bytes"] == 0  # nothing else of B's memory written
    assert m["source"]["bytes"] == m["target"]["bytes"] > 10**7
    assert m["target"]["verify"] == "sampled"
    # B runs it on, with A's output tokens
    assert m["target_output_ids"] == placed["output_ids"]
    assert m["after_step"]["output_ids"][:-1] == placed["output_ids"]
    assert m["after_step"]["seq_len"] == m["seq_len"] + 1
    # A's rows released after B verified: its pages back in its free lists, nothing lands after
    rel = m["released"]
    page = BASE.page_size
    assert rel["full_free"][1] - rel["full_free"][0] == -(-(TOKENS + STEPS) // page) * page, rel
    assert rel["swa_free"][1] > rel["swa_free"][0] and rel["slots_free"][1] == rel["slots_free"][0] + 1, rel
    assert rel["after_release_bytes"] == 0
    assert m["downtime_ms"] > 0


def test_an_unlike_target_is_refused_on_both_sides_and_the_request_stays_on_a(moves):
    r = moves["refused"]
    assert r["outcome"] == "refused", r
    assert r["handshake"]["error"].startswith("PageSizeMismatch: "), r["handshake"]
    assert "page_size=512" in r["handshake"]["error"]
    refused = [p for p in r["source_view"]["peers"] if p["error"] is not None]
    assert [p["error"] for p in refused] == ["PageSizeMismatch"], r["source_view"]
    assert "source" not in r and "target" not in r  # nothing paused, nothing allocated
    before, after = moves["before"], moves["after"]
    assert before["ok"] and after["ok"]
    assert before["items"] == after["items"] and before["output_ids"] == after["output_ids"]
    assert moves["still_runs"]["ok"] and moves["still_runs"]["seq_len"] == moves["kept"]["seq_len"] + 1
