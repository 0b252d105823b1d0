"""pdstate over SGLang's own DSV4 pool objects, 0.5.19's and 0.5.23's (built on CPU in child processes).

Every test runs once per release (``sglang_release``); pdstate's own pools are built for that
release (``upstream=``), and a refusal is the class and text of that release (``scenarios.expected``).

For every scenario the child builds the real ``DeepSeekV4TokenToKVPool`` target (+ NextN draft)
and ``SWATokenToKVPoolAllocator``, and pdstate's pools from the same constructor arguments, and
records what pdstate and SGLang's own ``setup_state_kv_args`` make of them. Here:

- the layout report from the real pair has the fingerprint (and factors) of pdstate's pair;
- pdstate's ``setup_state_kv_args`` on the real pools fills what SGLang's fills: the same state
  types, pointers, data and item lengths; the main KV channel likewise;
- a real draft with a mapping of its own refuses with the seed error locally, and from the peer:
  ``check_peer`` on the real side's report raises it in a pdstate prefill or decode;
- every other upstream refusal has the same text from both implementations.
"""

from __future__ import annotations

import pytest

from pdstate import errors
from pdstate.protocol.compat import check_peer, compat_errors
from pdstate.protocol.report import LayoutReport
from tests.sglang.scenarios import SEED, STAGE, VARIANTS, expected

ALL = [(variant, s) for variant, (_, scen) in VARIANTS.items() for s in scen if s not in STAGE]
OK = [pytest.param(v, s, id=f"{v}:{s['name']}") for v, s in ALL if s["expect"] == "ok"]
REFUSED = [pytest.param(v, s, id=f"{v}:{s['name']}") for v, s in ALL if s["expect"] != "ok"]
SEEDED = [p for p in REFUSED if p.values[1]["expect"] == "SWAIndexMappingNotShared"]


def _result(results: dict, variant: str, s: dict) -> dict:
    r = results[variant]["scenarios"][s["name"]]
    assert "crash" not in r, r.get("crash")
    return r


def _value(outcome: dict):
    assert outcome["ok"], outcome.get("error")
    return outcome["value"]


def _report(outcome: dict) -> LayoutReport:
    return LayoutReport.model_validate(_value(outcome))


def _shape(summary: dict) -> dict:
    """What must match across processes: types, pointer counts, data and item lengths."""
    return {
        "state_types": summary["state_types"],
        "n_ptrs": [len(p) for p in summary["ptrs"]],
        "data_lens": summary["data_lens"],
        "item_lens": summary["item_lens"],
    }


def test_the_children_built_real_sglang_pools(sglang_release, sglang_results):
    assert {r["sglang"] for r in sglang_results.values()} == {sglang_release.version}
    offline = sglang_results["offline"]
    assert offline["online_c128"] is False
    assert sglang_results["online"]["online_c128"] is True
    assert sglang_results["online_mtp"]["online_c128_mtp"] is True
    for variant, s in ALL:
        r = _result(sglang_results, variant, s)
        assert r["classes"]["target"] == "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool"
        assert r["classes"]["is_dsv4"] == [True, True]
        assert r["classes"]["real_unified"] is s["unified"]


@pytest.mark.parametrize("variant,s", OK)
def test_report_fingerprint_equals_pdstate_pools(sglang_results, variant, s):
    r = _result(sglang_results, variant, s)
    real, own = _report(r["report_real"]), _report(r["report_own"])
    assert dict(real.factors) == dict(own.factors)
    assert (real.page_size, real.kv_dtype) == (own.page_size, own.kv_dtype)
    assert real.fingerprint == own.fingerprint
    assert real.local_check.ok and own.local_check.ok
    assert (real.draft is None) == (s["draft"] == "none")


@pytest.mark.parametrize("variant,s", OK)
def test_kvargs_equal_sglang_setup_state_kv_args(sglang_results, variant, s):
    r = _result(sglang_results, variant, s)
    sglang, mine, own = (_value(r[k]) for k in ("sglang_on_real", "pdstate_on_real", "pdstate_on_own"))
    assert mine == sglang  # same process, same objects: the very same pointers too
    assert _shape(own) == _shape(sglang)
    want = ["swa"] + (["swa_ring"] if s["unified"] else []) + ["c128_state"]
    if s["pool"]["compression_ratios"].count(128) == 0:
        want.remove("c128_state")
    if s["draft"] != "none":
        want.append("swa_ring" if s["unified"] else "swa")
    assert sglang["state_types"] == want


@pytest.mark.parametrize("variant,s", OK)
def test_main_kv_channel_equals_sglang(sglang_results, variant, s):
    main = _value(_result(sglang_results, variant, s)["main_kv"])
    assert main["pdstate_on_real"] == main["real"]
    assert main["own"] == main["real"][1:]


@pytest.mark.parametrize("variant,s", REFUSED)
def test_refusals_match_sglang(sglang_release, sglang_results, variant, s):
    r = _result(sglang_results, variant, s)
    expect = expected(s, sglang_release.version)
    cls = getattr(errors, expect)
    mine, theirs = r["pdstate_on_real"], r["sglang_on_real"]
    assert not mine["ok"] and not theirs["ok"]
    assert mine["error"]["type"] == expect
    assert mine["error"]["message"] == theirs["error"]["message"]
    # SGLang raises the builtin pdstate's error class derives from (RuntimeError / AttributeError)
    assert theirs["error"]["type"] in mine["error"]["mro"]
    assert theirs["error"]["type"] == ("AttributeError" if issubclass(cls, AttributeError) else "RuntimeError")
    # pdstate's own pools refuse alike, and both reports carry it as their local check
    assert r["pdstate_on_own"]["error"]["message"] == theirs["error"]["message"]
    for key in ("report_real", "report_own"):
        check = _report(r[key]).local_check
        assert not check.ok and check.error.type == expect and check.error.message == theirs["error"]["message"]


@pytest.mark.parametrize("variant,s", SEEDED)
def test_seed_error_locally(sglang_results, variant, s):
    r = _result(sglang_results, variant, s)
    assert r["sglang_on_real"]["error"] == {
        "type": "RuntimeError",
        "message": SEED,
        "mro": r["sglang_on_real"]["error"]["mro"],
    }
    assert r["pdstate_on_real"]["error"]["message"] == SEED
    assert _report(r["report_real"]).local_check.error.message == SEED


def _good_peer(results: dict, variant: str, s: dict) -> LayoutReport:
    """pdstate's report of the same layout, correctly wired: the other side of the pair."""
    good = next(
        x
        for v, x in ALL
        if v == variant
        and x["expect"] == "ok"
        and x["draft"] == "shared"
        and x["unified"] == s["unified"]
        and x["pool"] == s["pool"]
        and x["speculative"] == s["speculative"]
    )
    return _report(_result(results, variant, good)["report_own"])


@pytest.mark.parametrize("our_role", ["prefill", "decode"])
@pytest.mark.parametrize("variant,s", SEEDED)
def test_seed_error_from_the_peer(sglang_results, variant, s, our_role):
    """A pdstate worker facing the real SGLang side's report refuses with the seed error."""
    theirs = _report(_result(sglang_results, variant, s)["report_real"])
    ours = _good_peer(sglang_results, variant, s)
    with pytest.raises(errors.SWAIndexMappingNotShared) as info:
        check_peer(ours, theirs, our_role)
    assert str(info.value) == SEED
    assert compat_errors(ours, theirs, our_role)[0].message == SEED


@pytest.mark.parametrize("our_role", ["prefill", "decode"])
@pytest.mark.parametrize("variant,s", OK)
def test_real_side_and_pdstate_side_are_compatible(sglang_results, variant, s, our_role):
    r = _result(sglang_results, variant, s)
    real, own = _report(r["report_real"]), _report(r["report_own"])
    check_peer(own, real, our_role)
    check_peer(real, own, our_role)
    assert compat_errors(own, real, our_role) == []


def test_view_derives_what_pdstate_pools_state(sglang_results):
    for variant, s in ALL:
        v = _result(sglang_results, variant, s)["view"]
        assert v["c4_ring_size"] == v["own_c4_ring_size"]
        assert v["c128_ring_size"] == v["own_c128_ring_size"]
        assert v["online_c128"] is variant.startswith("online")


@pytest.mark.parametrize("s", STAGE, ids=[s["name"] for s in STAGE])
def test_stage_rule(sglang_results, s):
    r = _result(sglang_results, "offline", s)
    real, own = _report(r["report_real"]), _report(r["report_own"])
    assert real.factor("stage") == own.factor("stage")
    assert real.fingerprint == own.fingerprint


@pytest.mark.parametrize("variant,s", OK)
def test_request_indices_equal_sglang(sglang_results, variant, s):
    """pdstate's index functions fed through the view compute what SGLang's own functions do."""
    got = _value(_result(sglang_results, variant, s)["indices"])
    has_c128 = 128 in s["pool"]["compression_ratios"]
    assert bool(got["c128"]) == has_c128
    assert bool(got["swa"]) == (not s["unified"])
    for slot, seq_len, mine, theirs in got["c128"]:
        assert mine == theirs, (slot, seq_len)
    for seq_len, mine, theirs in got["swa"]:
        assert mine == theirs and mine, seq_len
