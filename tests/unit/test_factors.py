"""``protocol.factors``: the registry every reader of a layout factor goes through, and the errors
that carry their factor as a field (also when rebuilt from a peer's class name and message)."""

from __future__ import annotations

import ast
import inspect

import pytest

from pdstate import errors as e
from pdstate.integrations.sglang.launch import consequences, knobs
from pdstate.protocol import compat, factors, fixes
from pdstate.protocol.report import FACTOR_NAMES, OPTIONAL_FACTOR_NAMES, diff, fingerprint
from tests.support.pools import TINY, report_of, tiny


def with_factors(report, **extra):
    carried = tuple(report.factors) + tuple(extra.items())
    return report.model_copy(
        update={"factors": carried, "fingerprint": fingerprint(report.page_size, report.kv_dtype, carried)}
    )


def test_the_report_names_are_the_registrys():
    assert FACTOR_NAMES == factors.names("state")
    assert (
        OPTIONAL_FACTOR_NAMES
        == factors.names("optional")
        == (
            "kv_layout",
            "kv_fp8_two_pool",
            "dspark",
            "allocation_policy",
        )
    )
    assert factors.names("field") == ("page_size", "kv_dtype")
    assert [n for n, _ in tiny().factors] == list(FACTOR_NAMES)


def test_each_refusal_class_names_the_factor_its_entry_is():
    for entry in factors.FACTORS.values():
        assert entry.fix is not None, entry.name
        if entry.error is not e.LayoutMismatch:
            assert entry.error.factor == entry.name
            assert entry.refusal is not None
    assert set(factors.error_kinds()) <= set(fixes.fixes_known())
    assert e.DescriptorMismatch("x").factor is None


def _real_refusals() -> list[BaseException]:
    t = TINY
    pairs = [
        (t, t.with_(page_size=512, swa_page_size=512, full_tokens=2048)),
        (t, t.with_(kv_dtype="float8_e5m2")),
        (t, t.with_(sliding_window=64)),
        (t, t.with_(speculative_num_draft_tokens=None, draft_enabled=False)),
    ]
    out: list[BaseException] = []
    for a, b in pairs:
        prefill, decode = report_of(a), report_of(b)
        out += [entry.refuse(prefill, decode) for entry in factors.refusal_order() if entry.name in _names(a, b)]
    out += [
        factors.FACTORS["allocation_policy"].refuse(tiny(), with_factors(tiny(), allocation_policy="prefill_complete")),
        factors.FACTORS["kv_layout"].refuse(tiny(), with_factors(tiny(), kv_layout="v41,c4:v41,c128:v4")),
    ]
    return out


def _names(a, b) -> set[str]:
    return {n for n, _, _ in diff(report_of(a), report_of(b))}


@pytest.mark.parametrize("refusal", _real_refusals(), ids=lambda r: f"{type(r).__name__}:{r.factor}")
def test_a_refusal_rebuilt_from_the_wire_carries_the_same_factor_and_values(refusal):
    back = e.error_from_wire(type(refusal).__name__, str(refusal))
    assert type(back) is type(refusal) and str(back) == str(refusal)
    assert (back.factor, back.prefill, back.decode) == (refusal.factor, refusal.prefill, refusal.decode)
    assert refusal.factor in factors.FACTORS
    assert fixes.fix_for(back) == fixes.fix_for(refusal) == fixes.fix_line(type(refusal).__name__, str(refusal))


def test_a_layout_mismatch_states_its_factor_and_values():
    err = e.LayoutMismatch.build("c4_ring", 8, 16)
    assert (err.factor, err.prefill, err.decode) == ("c4_ring", 8, 16)
    assert str(err) == (
        "DSV4 layout mismatch on c4_ring: prefill server has c4_ring=8, but decode server has c4_ring=16. "
        "Both servers must build the same state layout."
    )
    draft = e.error_from_wire("LayoutMismatch", str(e.LayoutMismatch.build("draft", {"layers": 1}, None)))
    assert (draft.factor, draft.prefill, draft.decode) == ("draft", {"layers": 1}, None)


@pytest.mark.parametrize(
    "kind, message",
    [
        ("LayoutMismatch", "something else entirely"),
        ("LayoutMismatch", "DSV4 layout mismatch on c4 ring: prefill server has c4 ring=1"),
        ("PageSizeMismatch", "Page size mismatch"),
        ("AllocationPolicyMismatch", ""),
    ],
)
def test_a_message_of_another_shape_leaves_the_values_unknown(kind, message):
    err = e.error_from_wire(kind, message)
    assert type(err).__name__ == kind and (err.prefill, err.decode) == (None, None)
    assert err.factor == (None if kind == "LayoutMismatch" else type(err).factor)


def test_the_fixes_read_no_error_text_with_a_regular_expression():
    tree = ast.parse(inspect.getsource(fixes))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "re" not in imported


def test_every_knobs_factor_is_registered_and_each_factor_has_its_effect():
    for knob in knobs.knobs():
        assert set(knob.factors) <= set(factors.FACTORS), knob.name
    assert [k.name for k in knobs.knobs()][-2:] == ["allocation_policy", "state_dtype"]
    assert consequences.consequence("allocation_policy", "early", "prefill_complete") == (
        "SGLang 0.5.23's decode fails every request of the pair (\"Disaggregation decode allocation policy "
        "mismatch: prefill=early, decode=prefill_complete\"), and pdstate's handshake refuses it"
    )
    assert consequences.consequence("kv_layout", "a", "b") == consequences.UNKNOWN_EFFECT


def test_a_factor_compared_by_its_own_rule():
    loose = factors.Factor("naming", "optional", "a test factor", same=lambda a, b: str(a).lower() == str(b).lower())
    with factors.registered(loose):
        upper, lower = with_factors(tiny(), naming="ABC"), with_factors(tiny(), naming="abc")
        assert diff(upper, lower) == []
        compat.check_peer(upper, lower, "prefill")
        other = with_factors(tiny(), naming="xyz")
        with pytest.raises(e.LayoutMismatch) as info:
            compat.check_peer(upper, other, "decode")
        assert info.value.factor == "naming" and (info.value.prefill, info.value.decode) == ("xyz", "ABC")
        # an optional factor a report does not carry is its default (None here), compared by the rule
        assert diff(upper, tiny()) == [("naming", "ABC", None)]


def test_registering_keeps_the_built_in_factors_and_their_order():
    before = tuple(factors.FACTORS)
    extra = factors.Factor("extra", "optional", "a test factor")
    with factors.registered(extra):
        assert tuple(factors.FACTORS) == (*before, "extra")
        with pytest.raises(ValueError, match="registered already"):
            factors.register(extra)
    assert tuple(factors.FACTORS) == before
    with pytest.raises(ValueError, match="built in"):
        factors.unregister("page_size")
