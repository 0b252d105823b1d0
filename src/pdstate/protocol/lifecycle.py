"""Lifecycles as tables: a request's and a peer's states, and the only way to move them.

``advance(current, new)`` checks a move against ``TRANSITIONS`` (requests) and ``peer_advance``
against ``PEER_TRANSITIONS`` (peers); terminal request states are final.
"""

from __future__ import annotations

import enum

from pdstate.errors import IllegalTransition


class PeerState(str, enum.Enum):
    PENDING = "pending"
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    GONE = "gone"


class RequestState(str, enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (RequestState.SUCCESS, RequestState.FAILED)


_S = RequestState
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    _S.BOOTSTRAPPING: frozenset({_S.WAITING_FOR_INPUT, _S.FAILED}),
    _S.WAITING_FOR_INPUT: frozenset({_S.TRANSFERRING, _S.FAILED}),
    _S.TRANSFERRING: frozenset({_S.SUCCESS, _S.FAILED}),
    _S.SUCCESS: frozenset(),
    _S.FAILED: frozenset(),
}


def advance(current: RequestState, new: RequestState) -> RequestState:
    """Check a lifecycle move against ``TRANSITIONS``; states only move forward."""
    if new not in TRANSITIONS[current]:
        raise IllegalTransition(f"request cannot move from {current.value} to {new.value}")
    return new
