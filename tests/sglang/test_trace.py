"""SGLang's request tracing sees pdstate's transfers (``integrations.sglang.trace``), on real SGLang code.

The pair driver's children (``sglang_pair``, shared) run SGLang's own ``observability.trace``
with a tracer that records spans (``devtools.sglang_pair.tracing``). On 0.5.23 (whose
``CommonKVManager`` has ``sender_trace_module``) one request traced with ``--trace-modules
pdstate`` has, on the prefill, SGLang's ``Sender Req`` root and pdstate's phases as slices, back
to back, and on the decode a ``Receiver Req`` root with its own phases; a transfer the handshake
refuses ends both in ``pdstate_bootstrap``, failed. Nothing is traced with
``--enable-trace`` off, or when ``--trace-modules`` leaves pdstate out; on 0.5.19 (no
``sender_trace_module``) nothing is traced at all.
"""

from __future__ import annotations

import pytest

from pdstate.devtools.sglang_pair.cases import CASES
from pdstate.devtools.sglang_pair.pair import SLACK_S

DEADLINE_S = 10.0
TRACED = {"0.5.23"}  # the releases whose CommonKVManager names a sender_trace_module
SENDER = ["pdstate_bootstrap", "pdstate_forward_wait", "pdstate_wire", "pdstate_verify"]
RECEIVER = ["pdstate_bootstrap", "pdstate_allocation_wait", "pdstate_wire", "pdstate_verify"]


def _request(pair, modules: str | None, enable: bool = True, outcome: str = "Success") -> tuple[int, dict]:
    """One request of the pair set up last, with tracing set so on both children: its room, and
    the spans each child recorded."""
    children = (pair.prefill, pair.decode)
    try:
        for child in children:
            reply = child.call("trace_on", SLACK_S, modules=modules, enable=enable)
            assert reply["ok"], reply
        result = pair.request(300, DEADLINE_S)
        assert (result["prefill"]["outcome"], result["decode"]["outcome"]) == (outcome, outcome), result
        return pair.room, {child.role: child.call("spans", SLACK_S)["spans"] for child in children}
    finally:
        for child in children:
            child.call("trace_off", SLACK_S)


def _timeline(spans: list[dict], role: str, room: int, outcome: str = "success") -> list[str]:
    """The slices under the one root span ``<role> Req <room>``, checked to tile it in order."""
    roots = [s for s in spans if s["parent"] is None]
    assert [r["name"] for r in roots] == [f"{role} Req {hex(room)}"], spans
    root = roots[0]
    assert root["attributes"]["module"] == "sglang::pdstate"
    assert root["attributes"]["pdstate.outcome"] == outcome
    (thread,) = [s for s in spans if s["parent"] == root["id"]]
    slices = sorted((s for s in spans if s["parent"] == thread["id"]), key=lambda s: s["start"])
    assert len(spans) == 2 + len(slices)
    assert slices[0]["start"] == root["start"]
    for a, b in zip(slices, slices[1:]):
        assert a["start"] <= a["end"] == b["start"], (a, b)
    assert slices[-1]["start"] <= slices[-1]["end"] <= root["end"]
    return [s["name"] for s in slices]


def test_a_traced_transfer_has_its_phases_as_spans(sglang_pair) -> None:
    p, d = sglang_pair.setup(CASES["correct"], "pdstate")
    assert p["ok"] and d["ok"], (p, d)
    room, spans = _request(sglang_pair, "pdstate")
    if sglang_pair.release not in TRACED:
        assert spans == {"prefill": [], "decode": []}
        return
    assert _timeline(spans["prefill"], "Sender", room) == SENDER
    assert _timeline(spans["decode"], "Receiver", room) == RECEIVER


def test_a_refused_transfer_ends_its_trace_failed_in_bootstrap(sglang_pair) -> None:
    p, d = sglang_pair.setup(CASES["c4_c128_order"], "pdstate")  # the handshake refuses it
    assert p["ok"] and d["ok"], (p, d)
    room, spans = _request(sglang_pair, "pdstate", outcome="Failed")
    if sglang_pair.release not in TRACED:
        assert spans == {"prefill": [], "decode": []}
        return
    assert _timeline(spans["prefill"], "Sender", room, "failed") == ["pdstate_bootstrap"]
    assert _timeline(spans["decode"], "Receiver", room, "failed") == ["pdstate_bootstrap"]


@pytest.mark.parametrize(("modules", "enable"), [("pdstate", False), ("mooncake", True)], ids=["off", "filtered"])
def test_nothing_is_traced_unless_asked(sglang_pair, modules: str, enable: bool) -> None:
    p, d = sglang_pair.setup(CASES["correct"], "pdstate")
    assert p["ok"] and d["ok"], (p, d)
    _, spans = _request(sglang_pair, modules, enable)
    assert spans == {"prefill": [], "decode": []}
