"""pdstate's SGLang backend between two processes: the real SGLang 0.5.19 code in a prefill and a
decode child (``pdstate.devtools.sglang_pair``), driven through ``get_kv_class("pdstate")`` in
SGLang's call order, over pdstate's Mooncake engine (TCP) — the backend's default."""

from __future__ import annotations

import pytest

from pdstate.devtools.sglang_pair.cases import CASES
from pdstate.devtools.sglang_pair.pair import Pair

REFUSED = {
    "spec_vs_nospec": "LayoutMismatch: DSV4 layout mismatch on c4_ring: prefill server has c4_ring=16, "
    "but decode server has c4_ring=8. Both servers must build the same state layout.",
    "c4_c128_order": "LayoutMismatch: DSV4 layout mismatch on compression_ratios: ",
    "window_64": "LayoutMismatch: DSV4 layout mismatch on sliding_window: prefill server has sliding_window=64, "
    "but decode server has sliding_window=128. Both servers must build the same state layout.",
    "draft_decode_only": "LayoutMismatch: DSV4 layout mismatch on draft: prefill server has draft=None, ",
    "page_size": "PageSizeMismatch: Page size mismatch: prefill server has page_size=512, "
    "but decode server has page_size=256. Both servers must use the same --page-size value.",
}


@pytest.fixture(scope="module")
def results(sglang_env) -> dict[str, dict]:
    with Pair(sglang_env) as pair:
        return {name: pair.run_case(CASES[name], "pdstate") for name in ["correct", *REFUSED]}


def _only_request(result: dict) -> dict:
    assert "setup_error" not in result, result.get("setup_error")
    (request,) = result["requests"]
    return request


def test_a_correct_pair_lands_every_byte(results):
    r = _only_request(results["correct"])
    assert (r["prefill"]["outcome"], r["decode"]["outcome"]) == ("Success", "Success")
    assert r["decode"]["wrong_items"] == 0 and r["decode"]["outside_bytes"] == 0
    assert r["decode"]["bytes_checked"] > 0


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refused_pair_fails_on_both_sides_at_once_with_the_factor_and_writes_nothing(results, case):
    r = _only_request(results[case])
    assert (r["prefill"]["outcome"], r["decode"]["outcome"]) == ("Failed", "Failed")
    assert r["prefill"]["failure"] == r["decode"]["failure"]
    assert r["prefill"]["failure"].startswith(REFUSED[case])
    assert r["decode"]["changed_bytes"] == 0
    assert r["elapsed_s"] < 1.5  # the whole request, both children's round trips included
