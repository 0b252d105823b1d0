"""The phases of a traced request, from its agent requests' stage times (``integrations.sglang.trace.phases``)."""

from __future__ import annotations

from pdstate.integrations.sglang.trace import phases

SENT = {"waiting_for_input_at_s": 0.5, "transferring_at_s": 0.75, "transfer_s": 1.0, "success_at_s": 2.0}


def test_a_sender_that_succeeded_has_every_phase_back_to_back() -> None:
    assert phases([SENT], sender=True) == [
        ("pdstate_bootstrap", None, 0.5),
        ("pdstate_forward_wait", 0.5, 0.75),
        ("pdstate_wire", 0.75, 1.75),
        ("pdstate_verify", 1.75, 2.0),
    ]


def test_a_receiver_names_its_allocation_wait_and_several_agents_take_the_latest() -> None:
    later = {**SENT, "transferring_at_s": 1.0, "success_at_s": 2.5}
    assert phases([SENT, later], sender=False) == [
        ("pdstate_bootstrap", None, 0.5),
        ("pdstate_allocation_wait", 0.5, 1.0),
        ("pdstate_wire", 1.0, 2.0),
        ("pdstate_verify", 2.0, 2.5),
    ]


def test_a_failed_request_has_the_phases_it_reached_the_last_ending_at_the_failure() -> None:
    failed = {"waiting_for_input_at_s": 0.5, "failed_at_s": 3.0}
    assert phases([failed], sender=False) == [("pdstate_bootstrap", None, 0.5), ("pdstate_allocation_wait", 0.5, 3.0)]


def test_no_times_no_phases() -> None:
    assert phases([], sender=True) == []
    assert phases([{"waiting_for_input_at_s": 0.5}], sender=True) == []  # not ended: nothing to trace yet
