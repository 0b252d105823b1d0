"""The agents' peer snapshots (``pdstate.protocol.peers``): frozen, slotted, read by attribute;
and the prefill's peer log, whose records they are."""

from __future__ import annotations

import dataclasses

import pytest

import pdstate
from pdstate.agent.refusals import PeerLog
from pdstate.protocol.lifecycle import PeerState
from pdstate.protocol.peers import DecodeSnapshot, PeerSnapshot, PrefillSnapshot
from pdstate.protocol.report import ErrorInfo

REFUSED = ErrorInfo(type="PageSizeMismatch", message="page_size differs: 256 vs 64")


@pytest.mark.parametrize(
    "snap",
    [
        PeerSnapshot("d-1", PeerState.ACCEPTED, "inc", "fp"),
        DecodeSnapshot("d-1", "inc", 0.25),
        PrefillSnapshot("tcp://h:1", PeerState.REJECTED, "p", "inc", 2, REFUSED, None, None, 1.5),
    ],
)
def test_a_snapshot_is_frozen_and_has_no_dict(snap):
    assert not hasattr(snap, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.incarnation = "other"  # type: ignore[misc]


def test_the_snapshot_types_are_public():
    assert {"PeerSnapshot", "DecodeSnapshot", "PrefillSnapshot"} <= set(pdstate.__all__)
    assert pdstate.PrefillSnapshot is PrefillSnapshot


def test_a_prefill_snapshot_says_its_error_in_one_line():
    p = PrefillSnapshot("tcp://h:1", PeerState.REJECTED, "p", "inc", 2, REFUSED, None, None, 1.5)
    assert p.reason == "PageSizeMismatch: page_size differs: 256 vs 64"
    assert p.state == "rejected" and p.state is PeerState.REJECTED
    ok = PrefillSnapshot("tcp://h:1", PeerState.ACCEPTED, "p", "inc", 3, None, "fp", 0.01, 0.2)
    assert ok.reason is None


def test_the_peer_log_keeps_snapshots_and_replaces_a_gone_one_in_place():
    log = PeerLog()
    log.note("a", PeerState.ACCEPTED, "inc-a", "fp-a", None)
    log.note("b", PeerState.REJECTED, "inc-b", "fp-b", REFUSED)
    before = log.records()
    log.gone("a", "inc-other", "missed heartbeats")  # another incarnation: not this record
    assert log.records() == before
    log.gone("a", "inc-a", "missed heartbeats for 3 s")
    gone = PeerSnapshot(
        "a", PeerState.GONE, "inc-a", "fp-a", ErrorInfo(type="PeerGone", message="missed heartbeats for 3 s")
    )
    assert log.records() == [gone, PeerSnapshot("b", PeerState.REJECTED, "inc-b", "fp-b", REFUSED)]
    assert before[0] == PeerSnapshot("a", PeerState.ACCEPTED, "inc-a", "fp-a", None)  # what was read stays as read
