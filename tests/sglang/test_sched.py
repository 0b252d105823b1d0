"""``pdstate bench``'s scheduler-thread measurement for real: both backends' sender and receiver
driven by SGLang's order in a prefill child and a decode child, 1 and 16 requests in flight, each
call's CPU on the calling thread, every byte of every request checked (one round, one release)."""

from __future__ import annotations

import pytest

from pdstate.devtools import bench_sched
from tests.sglang import runner

LOCK = runner.DEFAULT_RELEASE


@pytest.mark.parametrize("sglang_release", [LOCK], indirect=True, ids=[f"sglang-{LOCK}"])
def test_the_scheduler_threads_cpu_per_request_and_poll_for_both_backends(sglang_release, monkeypatch):
    from pdstate.devtools.sglang_pair.pair import mooncake_missing

    if why := mooncake_missing():
        pytest.skip(why)
    monkeypatch.setenv("PDSTATE_SGLANG_ENV", str(sglang_release.env))
    said, results = [], {}
    bench_sched.phase(True, results, progress=said.append, in_flight=(1, 16), rounds=1, releases=[LOCK])
    cpu, poll = results[bench_sched.CPU_KEY], results[bench_sched.POLL_KEY]
    assert list(cpu) == [LOCK] and list(poll) == [LOCK]
    assert {b: sorted(v) for b, v in cpu[LOCK].items()} == {"pdstate": ["1", "16"], "mooncake": ["1", "16"]}
    assert all(us > 0 for by_n in cpu[LOCK].values() for us in by_n.values()), cpu
    assert sorted(poll[LOCK]) == ["mooncake", "pdstate"] and all(us > 0 for us in poll[LOCK].values()), poll
    detail = results["sglang_sched"]["by_release"][LOCK]["pdstate"]
    # every request was polled on both sides until it ended, and its chunks went out
    assert all(n >= 2 for n in detail["polls_per_request"].values()), detail
    # and each ended with one poll that answered Success, on both sides
    kinds = detail["polls_by_kind"]
    assert all(kinds[n][side]["to Success"]["per_request"] == 1.0 for n in kinds for side in kinds[n]), kinds
    calls = detail["by_side_and_call_us"]["16"]
    assert all(calls["prefill"][c] > 0 for c in ("new", "init", "send", "poll")), calls
    assert all(calls["decode"][c] > 0 for c in ("new", "init", "send_metadata", "poll")), calls
    assert said[-2:] == [
        f"[sglang scheduler {LOCK}] {b}: "
        + ", ".join(f"{n} in flight {cpu[LOCK][b][n]:.0f} µs/request" for n in ("1", "16"))
        + f"; poll {poll[LOCK][b]:.1f} µs"
        for b in bench_sched.BACKENDS
    ]
