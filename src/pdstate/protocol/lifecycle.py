"""Lifecycles as tables: a request's and a peer's states, and the only way to move them.

``TRANSITIONS`` (requests) and ``PEER_TRANSITIONS`` (peers) list every legal move; ``advance``
checks one request move, ``move(record, new)`` checks a move of either kind against its table and
is the one place in the package that assigns a lifecycle state (a unit test scans the sources
for any other assignment). Records are born in their first state (``BOOTSTRAPPING``, ``PENDING``)
and never assign it themselves.

Terminal request states are final. Peer states have no terminal state: the decode registers again
after its prefill is gone or after it was refused and asked to retry.
"""

from __future__ import annotations

import enum
from typing import Any

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

    # whether the state is final (SUCCESS or FAILED): a plain attribute of each member, set below
    # (asked on every frame and every poll: no property call)
    terminal: bool


_S = RequestState
for _state in RequestState:
    _state.terminal = _state is _S.SUCCESS or _state is _S.FAILED
del _state
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    _S.BOOTSTRAPPING: frozenset({_S.WAITING_FOR_INPUT, _S.FAILED}),
    _S.WAITING_FOR_INPUT: frozenset({_S.TRANSFERRING, _S.FAILED}),
    _S.TRANSFERRING: frozenset({_S.SUCCESS, _S.FAILED}),
    _S.SUCCESS: frozenset(),
    _S.FAILED: frozenset(),
}

# The same state again is not a move: a caller that may meet it (a second answer to a register
# sent twice, a peer dropped twice) checks first. Who makes each move:
#   PENDING  -> ACCEPTED, REJECTED   the handshake's answer (prefill: its record of a register;
#                                    decode: the prefill's Accept or Reject, or an unreadable answer)
#   PENDING  -> GONE                 decode: the prefill restarted while a register was outstanding
#   ACCEPTED -> REJECTED             prefill: the decode refused this prefill's report after all;
#                                    decode: a later answer refused it
#   ACCEPTED -> GONE                 no heartbeat within the timeout, the prefill forgot the decode,
#                                    or (prefill) the decode registered again as a new incarnation
#   ACCEPTED, REJECTED, GONE -> PENDING
#                                    decode: asked to register again (``reregister``)
#   REJECTED -> GONE                 prefill: a refused decode came back as a new incarnation;
#                                    decode: the prefill that refused it restarted
#   REJECTED -> ACCEPTED             decode: an Accept to a register sent after the refusal
#   GONE     -> ACCEPTED, REJECTED   decode: the answer to the register it re-sends while gone
#   GONE     -> REJECTED             prefill: a decode's late refusal of this prefill, after the
#                                    decode had already timed out
_P = PeerState
PEER_TRANSITIONS: dict[PeerState, frozenset[PeerState]] = {
    _P.PENDING: frozenset({_P.ACCEPTED, _P.REJECTED, _P.GONE}),
    _P.ACCEPTED: frozenset({_P.REJECTED, _P.GONE, _P.PENDING}),
    _P.REJECTED: frozenset({_P.ACCEPTED, _P.GONE, _P.PENDING}),
    _P.GONE: frozenset({_P.ACCEPTED, _P.REJECTED, _P.PENDING}),
}

_TABLES: dict[type, tuple[str, dict[Any, frozenset[Any]]]] = {
    RequestState: ("request", TRANSITIONS),
    PeerState: ("peer", PEER_TRANSITIONS),
}


def check(current: RequestState | PeerState, new: RequestState | PeerState) -> None:
    """Raise ``IllegalTransition`` unless ``current -> new`` is in its table."""
    kind, table = _TABLES[type(current)]
    if type(new) is not type(current) or new not in table[current]:
        raise IllegalTransition(f"{kind} cannot move from {current.value} to {new.value}")


def advance(current: RequestState, new: RequestState) -> RequestState:
    """Check a request move against ``TRANSITIONS``; states only move forward."""
    if not isinstance(current, RequestState):
        raise TypeError(f"advance() moves request states, not {type(current).__name__}")
    check(current, new)
    return new


def move(record: Any, new: RequestState | PeerState) -> None:
    """Move ``record.state`` to ``new`` if its table allows it; raise ``IllegalTransition`` (and
    leave the record as it was) otherwise. The only assignment of a lifecycle state: records
    declare ``state`` with their first state as default, outside their constructor's arguments."""
    current = record.state
    if type(new) is not type(current) or new not in _TABLES[type(current)][1][current]:
        check(current, new)  # raises, with the refusal's words (``check`` alone writes them)
    record.state = new
