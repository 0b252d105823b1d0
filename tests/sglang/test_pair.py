"""Two processes, the real SGLang disaggregation code (0.5.19 and 0.5.23), every byte checked (``devtools.sglang_pair``).

One prefill child and one decode child (``sglang_pair``, shared by every case of a release) build
real DeepSeek-V4-Flash pools, fill ``KVArgs`` with SGLang's own functions and drive the managers
``get_kv_class`` returns in SGLang's call order. Every test runs once per release. With SGLang's
own Mooncake backend (over TCP) a correct pair lands every byte, and the mismatches of
``cases.MISMATCHES`` do what that release's backend alone does with them (measured; they differ:
0.5.23 compares the state components' item lengths and refuses some pairs on both sides): Success
with wrong bytes, a hang (cut by the driver's deadline), a refusal on both sides, or a decode-side
refusal the prefill never hears of. With backend ``pdstate`` each mismatch must end Failed on both
sides at once (``FAIL_FAST_S``), naming the factor, with no byte written, on both releases. docs/sglang.md's
mismatch table must be what this run renders (the release's column and pdstate's).
"""

from __future__ import annotations

import pytest

from pdstate.devtools.sglang_pair import table
from pdstate.devtools.sglang_pair.cases import CASES, MISMATCHES
from tests.sglang import runner
from tests.support.bounds import within
from tests.support.paths import REPO

HANG_S = 3.0  # the driver's deadline per side: what bounds SGLang's hangs here
# pdstate's deadline: it never hangs, so a longer one costs nothing and keeps a loaded machine's
# slow refusal (2.4 s measured under a load of 14 on 2 cores) a refusal, not a timeout
OURS_DEADLINE_S = 10.0
# Wall-clock bounds (``tests.support.bounds``), with what each measured on a quiet machine: a hang
# ends this long past the driver's deadline, a refusal ends both sides this long after the request
HANG_LATE_S, HANG_LATE_QUIET_S = 10.0, 0.5
FAIL_FAST_S, FAIL_FAST_QUIET_S = 5.0, 0.6


# What SGLang's own Mooncake backend does with each mismatch, per release (measured with this
# driver; ../shared/reference/sglang_cpu.md).
class V0519:
    WRONG_BYTES = {"spec_vs_nospec", "nospec_vs_spec", "draft_decode_only", "c4_c128_order", "window_256", "window_64"}
    OUTSIDE_BYTES = {"spec_vs_nospec", "nospec_vs_spec"}  # ring rows of 16 vs 8: writes past the item
    HANGS = {"draft_prefill_only", "c4_c128_counts"}
    REFUSED_BOTH = set()
    DECODE_REFUSES = {"page_size"}


class V0523:
    # 0.5.23 compares each state component's item lengths (and their count) before it writes
    REFUSED_BOTH = {
        "spec_vs_nospec": "StateType.SWA item length mismatch for positional entry 43",
        "nospec_vs_spec": "StateType.SWA item length mismatch for positional entry 43",
        "c4_c128_counts": "StateType.SWA decode published 81 item lengths for this stage's 85 entries",
    }
    # the decode's extra draft SWA component is never written; a C4/C128 swap or another window
    # has the same item lengths
    WRONG_BYTES = {"draft_decode_only", "c4_c128_order", "window_256", "window_64"}
    OUTSIDE_BYTES = set()
    HANGS = {"draft_prefill_only"}  # one state list more on the prefill: its transfer thread stops
    DECODE_REFUSES = {"page_size"}


def mooncake_expect(release: str):
    """What SGLang's Mooncake backend does on ``release`` (its row's ``mooncake_checks_item_lens``)."""
    return V0523 if runner.row(release).mooncake_checks_item_lens else V0519


@pytest.fixture(scope="module")
def results(sglang_pair) -> tuple[dict, dict]:
    sglang = {name: sglang_pair.run_case(case, "mooncake", deadline_s=HANG_S) for name, case in CASES.items()}
    ours = {name: sglang_pair.run_case(case, "pdstate", deadline_s=OURS_DEADLINE_S) for name, case in CASES.items()}
    return sglang, ours


def _only(result: dict) -> dict:
    assert "setup_error" not in result, result["setup_error"]
    assert len(result["requests"]) == 1
    return result["requests"][0]


def _ours(results) -> dict:
    return results[1]


def test_sglang_mooncake_correct_pair_is_byte_exact(results):
    r = _only(results[0]["correct"])
    assert r["prefill"]["outcome"] == r["decode"]["outcome"] == "Success"
    dec = r["decode"]
    assert dec["wrong_items"] == 0 and dec["outside_bytes"] == 0
    assert dec["items"] > 300 and dec["bytes_checked"] > 10**8  # main KV, SWA, C4/C128 state, draft, aux
    assert dec["changed_bytes"] > 10**7  # the request's items, all of them right
    assert r["send_to_success_ms"] > 0


@pytest.mark.parametrize("name", [c.name for c in MISMATCHES])
def test_sglang_alone_on_a_mismatch(sglang_release, results, name):
    expect = mooncake_expect(sglang_release.version)
    r = _only(results[0][name])
    pre, dec = r["prefill"], r["decode"]
    if name in expect.WRONG_BYTES:
        assert pre["outcome"] == dec["outcome"] == "Success"
        assert dec["wrong_items"] > 0
        assert (dec["outside_bytes"] > 0) == (name in expect.OUTSIDE_BYTES)
    elif name in expect.HANGS:
        assert pre["outcome"].startswith("timeout") and dec["outcome"].startswith("timeout")
        # the driver's deadline bounds it
        within("a hang cut past the driver's deadline", r["elapsed_s"] - HANG_S, HANG_LATE_S, HANG_LATE_QUIET_S)
    elif name in expect.REFUSED_BOTH:
        assert pre["outcome"] == dec["outcome"] == "Failed", (pre, dec)
        assert table.reason_of(pre["failure"]) == expect.REFUSED_BOTH[name]
        assert dec["changed_bytes"] == 0
    else:
        assert name in expect.DECODE_REFUSES
        assert dec["outcome"] == "refused" and dec["failure"].startswith("RuntimeError: Page size mismatch")
        assert pre["outcome"] == "timeout (Bootstrapping)"


def test_the_children_run_the_release_asked_for(sglang_release, results):
    for backend_results in results:
        assert {r["sglang"] for r in backend_results.values()} == {sglang_release.version}


def test_pdstate_backend_correct_pair_is_byte_exact(results):
    r = _only(_ours(results)["correct"])
    assert r["prefill"]["outcome"] == r["decode"]["outcome"] == "Success"
    assert r["decode"]["wrong_items"] == 0 and r["decode"]["outside_bytes"] == 0
    assert r["decode"]["changed_bytes"] > 10**7


@pytest.mark.parametrize("name", [c.name for c in MISMATCHES])
def test_pdstate_backend_refuses_a_mismatch(results, name):
    r = _only(_ours(results)[name])
    pre, dec = r["prefill"], r["decode"]
    assert pre["outcome"] == dec["outcome"] == "Failed", (pre, dec)
    within("a refusal ending both sides (sglang_pair)", r["elapsed_s"], FAIL_FAST_S, FAIL_FAST_QUIET_S)
    factor = CASES[name].factor
    assert table.factor_of(pre["failure"]) == factor, pre["failure"]
    assert table.factor_of(dec["failure"]) == factor, dec["failure"]
    assert dec["changed_bytes"] == 0  # not one byte of the decode's memory written


def _at_quiet_speed(results: dict) -> dict:
    """``results`` with each request's time within ``FAIL_FAST_S`` replaced by what it measures on a
    quiet machine (``FAIL_FAST_QUIET_S``): the table states a quiet machine's time, and this run's
    own is bounded by ``test_pdstate_backend_refuses_a_mismatch`` (a time past the bound stays)."""

    def quiet(r: dict) -> dict:
        return {**r, "elapsed_s": FAIL_FAST_QUIET_S} if r.get("elapsed_s", FAIL_FAST_S) < FAIL_FAST_S else r

    return {
        name: {**res, "requests": [quiet(r) for r in res["requests"]]} if "requests" in res else res
        for name, res in results.items()
    }


def test_readme_table_is_the_rendered_one(sglang_release, results):
    sglang, ours = results
    readme = table.columns(table.readme_table((REPO / table.TARGET).read_text()))
    ours = _at_quiet_speed(ours)  # the readme's "in < 1 s" is a quiet machine's time
    rendered = table.columns(table.render({sglang_release.version: sglang}, {sglang_release.version: ours}))
    assert list(readme) == list(rendered)  # the same columns: case, one per release, pdstate
    column = table.sglang_column(sglang_release.version)
    assert readme[table.CASE_COLUMN] == rendered[table.CASE_COLUMN]
    assert readme[column] == rendered[column]  # SGLang alone on this release
    assert readme[table.OURS_COLUMN] == rendered[table.OURS_COLUMN]  # pdstate: the same on every release
