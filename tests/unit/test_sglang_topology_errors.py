"""What backend pdstate keeps of a prefill whose ranks SGLang cannot map: the text bounded and
escaped (it came from the prefill's ``/route`` answer, and the address from a request), and a
bounded number of prefills remembered."""

from __future__ import annotations

from pdstate.integrations.sglang.manager import (
    MAX_TOPOLOGY_ERRORS,
    PEER_TEXT_CHARS,
    peer_text,
    remember_topology_error,
)


def test_the_reason_is_sglangs_text_escaped():
    errors: dict[str, str] = {}
    remember_topology_error(errors, "10.0.0.1:8998", AssertionError("prefill tp 3\x1b[2J\nis not a multiple"))
    assert errors == {"10.0.0.1:8998": "SGLang cannot map these ranks: prefill tp 3\\x1b[2J\\nis not a multiple"}


def test_a_long_text_is_clipped():
    errors: dict[str, str] = {}
    remember_topology_error(errors, "p:1", AssertionError("x" * 100_000))
    reason = errors["p:1"]
    assert reason.startswith("SGLang cannot map these ranks: xxx")
    assert reason == "SGLang cannot map these ranks: " + "x" * 984 + "…(+99016 chars)"
    assert len(reason) <= len("SGLang cannot map these ranks: ") + PEER_TEXT_CHARS


def test_peer_text_escapes_an_address():
    assert peer_text("evil\r\n2026-01-01 ERROR forged") == "evil\\r\\n2026-01-01 ERROR forged"
    assert len(peer_text("a" * 5000)) == PEER_TEXT_CHARS


def test_the_oldest_prefill_is_forgotten_first():
    errors: dict[str, str] = {}
    forgotten = [
        f
        for i in range(MAX_TOPOLOGY_ERRORS + 10)
        for f in remember_topology_error(errors, f"p{i}:1", AssertionError(str(i)))
    ]
    assert forgotten == [f"p{i}:1" for i in range(10)]
    assert len(errors) == MAX_TOPOLOGY_ERRORS
    assert next(iter(errors)) == "p10:1"
    assert errors[f"p{MAX_TOPOLOGY_ERRORS + 9}:1"] == f"SGLang cannot map these ranks: {MAX_TOPOLOGY_ERRORS + 9}"
    assert remember_topology_error(errors, "p10:1", AssertionError("again")) == []  # seen again: now the newest
    assert list(errors)[-1] == "p10:1" and len(errors) == MAX_TOPOLOGY_ERRORS
