"""Two processes, the real SGLang 0.5.19 disaggregation code, every byte checked (``devtools.sglang_pair``).

One prefill child and one decode child (``sglang_pair``, shared by every case here) build real DeepSeek-V4-Flash
pools, fill ``KVArgs`` with SGLang's own functions and drive the managers ``get_kv_class`` returns
in SGLang's call order. With SGLang's own Mooncake backend (over TCP) a correct pair lands every
byte, and the mismatches of ``cases.MISMATCHES`` do what SGLang alone does with them: Success with
wrong bytes, a hang (cut by the driver's deadline), or a decode-side refusal the prefill never
hears of. With backend ``pdstate`` each mismatch must end Failed on both sides in under a second,
naming the factor, with no byte written. README's
mismatch table must be what this run renders.
"""

from __future__ import annotations

import pytest

from pdstate.devtools.sglang_pair import table
from pdstate.devtools.sglang_pair.cases import CASES, MISMATCHES
from tests.support.paths import REPO

HANG_S = 3.0  # the driver's deadline per side: what bounds SGLang's hangs here
FAIL_FAST_S = 1.0

# What SGLang 0.5.19's own backend does with each mismatch (measured; ../shared/reference/sglang_cpu.md).
WRONG_BYTES = {"spec_vs_nospec", "nospec_vs_spec", "draft_decode_only", "c4_c128_order", "window_256", "window_64"}
OUTSIDE_BYTES = {"spec_vs_nospec", "nospec_vs_spec"}  # ring rows of 16 vs 8: writes past the item
HANGS = {"draft_prefill_only", "c4_c128_counts"}
DECODE_REFUSES = {"page_size"}


@pytest.fixture(scope="module")
def results(sglang_pair) -> tuple[dict, dict]:
    sglang = {name: sglang_pair.run_case(case, "mooncake", deadline_s=HANG_S) for name, case in CASES.items()}
    ours = {name: sglang_pair.run_case(case, "pdstate", deadline_s=HANG_S) for name, case in CASES.items()}
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
def test_sglang_alone_on_a_mismatch(results, name):
    r = _only(results[0][name])
    pre, dec = r["prefill"], r["decode"]
    if name in WRONG_BYTES:
        assert pre["outcome"] == dec["outcome"] == "Success"
        assert dec["wrong_items"] > 0
        assert (dec["outside_bytes"] > 0) == (name in OUTSIDE_BYTES)
    elif name in HANGS:
        assert pre["outcome"].startswith("timeout") and dec["outcome"].startswith("timeout")
        assert r["elapsed_s"] < 3 * HANG_S  # the driver's deadline bounds it
    else:
        assert name in DECODE_REFUSES
        assert dec["outcome"] == "refused" and dec["failure"].startswith("RuntimeError: Page size mismatch")
        assert pre["outcome"] == "timeout (Bootstrapping)"


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
    assert r["elapsed_s"] < FAIL_FAST_S
    factor = CASES[name].factor
    assert table.factor_of(pre["failure"]) == factor, pre["failure"]
    assert table.factor_of(dec["failure"]) == factor, dec["failure"]
    assert dec["changed_bytes"] == 0  # not one byte of the decode's memory written


def test_readme_table_is_the_rendered_one(results):
    sglang, ours = results
    readme = [table.split_row(row) for row in table.readme_table((REPO / "README.md").read_text()).splitlines()]
    rendered = [table.split_row(row) for row in table.render(sglang, ours).splitlines()]
    assert [row[:2] for row in readme] == [row[:2] for row in rendered]  # case, SGLang alone
    if ours is not None:
        assert [row[2:] for row in readme] == [row[2:] for row in rendered]  # with pdstate (the rule row has one cell)
