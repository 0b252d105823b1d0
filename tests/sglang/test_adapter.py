"""pdstate as SGLang's transfer backend, driven in SGLang's call order against the real code of each release.

Every test runs once per release (0.5.19 and 0.5.23: ``sglang_release``), on that release's
base-class contract (0.5.23: keyword-only senders, ``init`` without SGLang's ZMQ registration).

One child process (``adapter_probe.py``) holds both sides over the ``loopback`` engine: real
DSV4 pools (target + NextN draft), ``KVArgs`` filled by SGLang's own functions, SGLang's bootstrap
server, and the manager / sender / receiver classes ``get_kv_class`` returns for ``pdstate``.
"""

from __future__ import annotations

import pytest

from pdstate.integrations.sglang.launch.backend import tokenizer_workers_refusal
from tests.sglang import runner
from tests.support.bounds import within

CASES = [
    "hooks",
    "ok",
    "early",
    "ok_unified",
    "mismatch",
    "mismatch_sender_late",
    "seed",
    "tp_dummy",
    "decode_tp_wider",
    "pp_refused",
    "io_thread_ends",
    "cp_refused",
    "tokenizer_workers",
    "prefix",
    "prefill_complete",
    "prefill_dp",
]
ENV = {"PDSTATE_TRANSFER__ENGINE": "loopback", "SGLANG_HOST_IP": "127.0.0.1"}
# KVPoll's values in SGLang 0.5.19 and 0.5.23 (sglang.srt.disaggregation.base.conn.KVPoll)
FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS = 0, 1, 2, 3, 4
C4_RING = (
    "DSV4 layout mismatch on c4_ring: prefill server has c4_ring=16, but decode server has c4_ring=8. "
    "Both servers must build the same state layout."
)
SEED = "DSV4 target and draft pools must share the SWA index mapping"
# A refused pair's two sides end this long after the decode's init at most (``tests.support.bounds``;
# beside it, what that measured on a quiet machine): at once, not at the probe's 10 s deadline
REFUSED_ENDS_S, REFUSED_ENDS_QUIET_S = 2.5, 0.2


@pytest.fixture(scope="module")
def results(sglang_release) -> dict:
    out = runner.run_probe(sglang_release.env, ENV, CASES, 300, "adapter_probe.py")
    assert "setup" not in out, out["setup"].get("error")
    assert out.pop("sglang")["release"] == sglang_release.version
    for name, r in out.items():
        assert r["ok"], f"{name}\n{r.get('error')}"
    return out


def test_a_correct_pair_moves_every_byte_where_sglang_puts_it(results):
    r = results["ok"]
    assert (r["sender_first"], r["receiver_first"]) == (BOOTSTRAPPING, BOOTSTRAPPING)
    assert (r["receiver_bootstrapped"], r["sender_bootstrapped"]) == (WAITING, WAITING)
    assert r["after_first_chunk"] == TRANSFERRING  # the state goes with the second chunk only
    assert (r["sender"], r["receiver"]) == (SUCCESS, SUCCESS)
    # main KV (target C4, indexer, C128), target SWA component, C128 state, draft SWA, aux
    assert r["channels"] == ["main", "swa", "c128_state", "swa", "aux"]
    assert r["bytes_differing"] == 0  # every destination byte: the source item, or the sentinel
    assert r["bytes_moved"] > 2_000_000
    assert r["metric"]["transfer_total_bytes"] >= r["bytes_moved"]


def test_a_receiver_of_an_accepted_prefill_waits_for_input_right_after_init(results):
    """Its agent receiver would start WaitingForInput: the poll says so before the agent's thread
    made it (held), the destination named meanwhile follows, and every byte lands."""
    r = results["early"]
    assert r["first"] == [SUCCESS, SUCCESS]
    assert (r["after_init"], r["after_metadata"]) == (WAITING, TRANSFERRING)
    assert (r["sender"], r["receiver"]) == (SUCCESS, SUCCESS), r
    assert r["bytes_differing"] == 0


def test_the_adapter_follows_the_releases_base_class_contract(sglang_release, results):
    r = results["ok"]
    if sglang_release.new_api:  # 0.5.23's prefill: keywords only, no dest_tp_ranks / pp_rank
        assert r["sender_params"] == ["mgr", "bootstrap_addr", "bootstrap_room", "req_has_disagg_prefill_dp_rank"]
    else:
        assert r["sender_params"] == [
            "mgr", "bootstrap_addr", "bootstrap_room", "dest_tp_ranks", "pp_rank", "req_has_disagg_prefill_dp_rank"
        ]  # fmt: skip
    assert r["sglang_zmq_calls"] == []  # the receiver's init never takes SGLang's ZMQ registration


def test_the_schedulers_other_hooks_run_without_sglangs_zmq(sglang_release, results):
    r = results["hooks"]
    assert r["sglang_zmq_calls"] == []
    assert r["receiver_abort"]["ok"] and r["receiver_clear"]["ok"] and r["sender_abort"]["ok"]
    assert r["sender_clear"]["ok"] and r["ensure_abort_notified"]["ok"]
    if sglang_release.new_api:  # 0.5.23's hooks exist and answer as a whole-request backend
        assert r["max_transfer_tokens"] == {"ok": True, "value": None}
        assert r["decode_prefix_len"] == {"ok": True, "value": 0}
        assert r["should_send"] == {"ok": True, "value": True}
        assert r["mark_prefill_complete"]["ok"]
    # deferred decode KV release (0.5.23's setting, on by default), acknowledged as the fence holds
    assert (r["supports_deferred"], r["deferred_release"]) == (True, sglang_release.row.deferred_kv_release)
    assert r["torn_down"] is True
    assert r["agent_timeouts"] == [330.0, 330.0]  # SGLang's own timeouts fail a request first, with its text


def test_a_decode_prefix_hit_moves_only_the_suffix_and_ends_as_a_full_transfer(results):
    """decode_prefix_len (0.5.23's decode radix cache; on 0.5.19 SGLang itself refuses DSV4 with a
    decode radix cache at launch, and the adapter's path is the same): only the pages past the
    prefix and the SWA window from there move, state and aux whole, and the decode's memory ends
    byte-equal to a full transfer's."""
    r = results["prefix"]
    assert r["full"] == {"sender": SUCCESS, "receiver": SUCCESS}, r
    assert (r["prefix"]["sender"], r["prefix"]["receiver"]) == (SUCCESS, SUCCESS), r
    assert (r["pages_full"], r["pages_prefix"], r["swa_pages_dropped"]) == (2, 1, 1)
    assert r["reset_bytes"] > 0  # the suffix's items were reset, so the second transfer wrote them again
    assert r["bytes_differing_from_full"] == 0
    assert 0 < r["bytes_prefix"] < r["bytes_full"], r  # counted: the prefix page and its SWA page did not move


def test_what_sglang_refuses_at_start_stays_sglangs(sglang_release, results):
    """0.5.23's prefill_complete allocation: SGLang's own manager refuses DSV4's state components at
    start (one line, any backend); runtime role switch: SGLang's own check refuses it from the
    manager's ``supports_role_switch``."""
    r = results["prefill_complete"]
    assert r["supports_role_switch"] is False
    if sglang_release.new_api:
        assert r["error"] == {
            "type": "ValueError",
            "message": "prefill_complete currently supports full-attention and DSA KV pools only",
        }, r


def test_a_prefill_with_dp_attention_serves_the_room_from_its_dp_rank(sglang_release, results):
    """Two prefill DP ranks behind one bootstrap server: the room's prefill DP rank (as a router
    names it) picks the rank through SGLang's own ``/route``; that rank's bytes land, byte-exact."""
    r = results["prefill_dp"]
    if not sglang_release.new_api:
        pytest.skip("0.5.19 reads the DP width from process globals this one-process probe sets once")
    assert r["routed"] == [r["agents"][1]], r
    assert (r["sender"], r["receiver"]) == (SUCCESS, SUCCESS), r
    assert r["bytes_differing"] == 0


def test_unified_kv_pools_move_their_swa_rings_byte_exact(results):
    r = results["ok_unified"]
    assert (r["sender"], r["receiver"]) == (SUCCESS, SUCCESS)
    assert r["channels"] == ["main", "swa", "swa_ring", "c128_state", "swa_ring", "aux"]
    assert r["bytes_differing"] == 0


@pytest.mark.parametrize(
    ("case", "message"),
    [("mismatch", C4_RING), ("mismatch_sender_late", C4_RING), ("seed", SEED)],
)
def test_a_refused_pair_fails_on_both_sides_at_once_and_writes_nothing(results, case, message):
    r = results[case]
    assert (r["receiver_bootstrapped"], r["sender_bootstrapped"]) == (FAILED, FAILED)
    assert (r["sender"], r["receiver"]) == (FAILED, FAILED)
    within(f"a refused pair's two sides ended ({case})", r["both_ended_s"], REFUSED_ENDS_S, REFUSED_ENDS_QUIET_S)
    assert r["receiver_error"]["message"] == message
    assert r["sender_error"] == r["receiver_error"]
    assert r["bytes_written"] == 0


def test_the_seed_error_keeps_upstreams_class(results):
    assert results["seed"]["sender_error"]["type"] == "SWAIndexMappingNotShared"
    assert results["mismatch"]["sender_error"]["type"] == "LayoutMismatch"


def test_a_wider_prefill_tp_sends_from_one_rank_the_others_complete_as_dummies(results):
    r = results["tp_dummy"]
    assert r["dummies"] == [False, True]  # SGLang's own mapping for MLA-like KV
    assert r["senders"] == [SUCCESS, SUCCESS] and r["receiver"] == SUCCESS
    assert r["sent_bytes"][0] > 2_000_000 and r["sent_bytes"][1] == 0
    assert r["bytes_differing"] == 0  # rank 0's bytes, none of rank 1's


def test_a_wider_decode_tp_asks_under_a_room_per_decode_rank(results):
    """Both decode ranks of attention TP 2 take the room from prefill rank 0 (SGLang's mapping), each
    under a room of its own (the prefill's sender sends to both: ``replicas``); none is refused."""
    from pdstate.integrations.sglang.replicas import replica_room

    r = results["decode_tp_wider"]
    assert r["required_dst_info_num"] == 2
    assert FAILED not in r["receivers"], r
    assert r["rooms"] == [[replica_room(3001, 0, 2)], [replica_room(3001, 1, 2)]]
    assert len({3001, replica_room(3001, 0, 2), replica_room(3001, 1, 2)}) == 3


def test_what_stays_refused_of_pipeline_parallelism_stops_the_manager_saying_so(results):
    """A PP prefill without a draft is served (``test_scheduler_queues_topologies.py``); a stage
    with a draft model, and a decode of several stages, are refused at start."""
    r = results["pp_refused"]
    assert {side: r[side] for side in ("prefill_with_draft", "decode")} == {
        "prefill_with_draft": "pdstate's SGLang backend does not move a draft model's KV from a pipeline-parallel "
        "prefill yet (pp_size=2): use --disaggregation-transfer-backend mooncake",
        "decode": "pdstate's SGLang backend does not support pipeline parallelism on a decode yet (pp_size=2; "
        "a PP prefill is served into a decode of one stage): use --disaggregation-transfer-backend mooncake",
    }


def test_an_agent_thread_that_ends_fails_the_requests_with_a_reason(results):
    r = results["io_thread_ends"]
    assert r["sender"] == FAILED and r["sender_error"]["type"] == "AgentClosed"
    assert "I/O thread has ended unexpectedly" in r["sender_error"]["message"]
    assert r["receiver"] == FAILED and r["receiver_error"]["type"] == "PeerGone"
    assert r["receiver_error"]["message"].endswith("missed heartbeats for 0.5 s")


def test_several_tokenizer_workers_stop_the_manager_where_they_cannot_know_pdstate(sglang_release, results):
    """0.5.19's tokenizer workers import SGLang's own app (no SGLANG_HTTP_SERVER_APP_PATH): the
    manager, built by the schedulers SGLang waits for before it spawns those workers, refuses 2 at
    start with ``launch.backend``'s line; 0.5.23's import pdstate's ``worker_app``: served."""
    r = results["tokenizer_workers"]
    assert r["tokenizer_worker_num"] == 2
    if runner.row(sglang_release.version).tokenizer_workers_app_path:
        assert r["error"] is None
    else:
        assert r["error"] == tokenizer_workers_refusal(2, app_path_setting=False)
        assert r["error"] == (
            "pdstate's SGLang backend cannot reach the tokenizer worker processes of an SGLang without "
            "SGLANG_HTTP_SERVER_APP_PATH (0.5.19; tokenizer_worker_num=2): use --tokenizer-worker-num 1, "
            "or SGLang 0.5.23"
        )


def test_context_parallelism_stops_the_manager_saying_so(results):
    assert results["cp_refused"]["error"] == (
        "pdstate's SGLang backend does not support context parallelism yet (attn_cp_size=2, "
        "attn_dcp_size=1): use --disaggregation-transfer-backend mooncake"
    )
