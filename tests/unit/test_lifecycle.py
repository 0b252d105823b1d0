"""The peer lifecycle table, ``move`` (the one way a record's state changes), and a scan of the
sources proving nothing else assigns a lifecycle state."""

from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pdstate.agent.common import RequestRecord
from pdstate.errors import IllegalTransition
from pdstate.protocol import lifecycle
from pdstate.protocol.lifecycle import PEER_TRANSITIONS, TRANSITIONS, PeerState, RequestState, move

P = PeerState
R = RequestState


@dataclass
class PrefillLink:
    """A decode's view of one prefill, as a record holding a peer lifecycle state."""

    endpoint: str
    state: PeerState = field(default=PeerState.PENDING, init=False)


def test_peer_table():
    assert PEER_TRANSITIONS == {
        P.PENDING: {P.ACCEPTED, P.REJECTED, P.GONE},
        P.ACCEPTED: {P.REJECTED, P.GONE, P.PENDING},
        P.REJECTED: {P.ACCEPTED, P.GONE, P.PENDING},
        P.GONE: {P.ACCEPTED, P.REJECTED, P.PENDING},
    }
    assert set(PEER_TRANSITIONS) == set(P)


def test_a_decode_registers_again_after_gone_or_rejected():
    link = PrefillLink("tcp://127.0.0.1:1")
    for state in (P.ACCEPTED, P.GONE, P.ACCEPTED, P.PENDING, P.REJECTED, P.PENDING, P.ACCEPTED):
        move(link, state)
        assert link.state is state


def _moves_by_its_table(obj, a, b, table, kind: str) -> None:
    """``move(obj, b)`` from ``a``: done where ``table`` allows it, else refused, ``obj`` unchanged."""
    if b in table[a]:
        move(obj, b)
        assert obj.state is b
    else:
        with pytest.raises(IllegalTransition) as info:
            move(obj, b)
        assert str(info.value) == f"{kind} cannot move from {a.value} to {b.value}"
        assert obj.state is a


@pytest.mark.parametrize("a,b", list(itertools.product(P, P)))
def test_peer_moves_outside_the_table_raise(a, b):
    link = PrefillLink("tcp://127.0.0.1:1")
    object.__setattr__(link, "state", a)  # the scan below allows nothing but move(); tests set up freely
    _moves_by_its_table(link, a, b, PEER_TRANSITIONS, "peer")


@pytest.mark.parametrize("a,b", list(itertools.product(R, R)))
def test_request_moves_follow_their_table(a, b):
    class Rec:
        state = a

    _moves_by_its_table(Rec(), a, b, TRANSITIONS, "request")


def test_a_state_of_the_other_kind_is_refused():
    class Rec:
        state = R.BOOTSTRAPPING

    with pytest.raises(IllegalTransition):
        move(Rec(), P.ACCEPTED)
    with pytest.raises(TypeError):
        lifecycle.advance(P.PENDING, P.ACCEPTED)


def test_records_are_born_in_their_first_state():
    assert RequestRecord(7).state is R.BOOTSTRAPPING  # the agent's request record
    assert PrefillLink("tcp://127.0.0.1:1").state is P.PENDING
    with pytest.raises(TypeError):
        PrefillLink("tcp://127.0.0.1:1", state=P.ACCEPTED)


# --- nothing but lifecycle.move assigns a lifecycle state ----------------------------------------

SRC = Path(lifecycle.__file__).resolve().parents[1]  # src/pdstate
ALLOWED = {Path(lifecycle.__file__).resolve()}
# attributes that hold a lifecycle state anywhere in the package (records' ``state``, and the
# decode's former ``peer_state``, so it cannot come back as a plain attribute)
STATE_ATTRS = {"state", "peer_state"}


def _targets(node: ast.AST):
    if isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            yield from _targets(elt)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)
    else:
        yield node


def state_assignments(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, what)`` for every assignment to a lifecycle attribute: ``x.state = ...`` (also in
    tuples, augmented or annotated, or via ``setattr``/``object.__setattr__`` with a constant
    name), ``x.__dict__["state"] = ...``, and ``state=`` passed to a record's constructor."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in _targets(target)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            targets = list(_targets(node.target))
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in STATE_ATTRS:
                found.append((node.lineno, f"assigns .{t.attr}"))
            if (
                isinstance(t, ast.Subscript)
                and isinstance(t.value, ast.Attribute)
                and t.value.attr == "__dict__"
                and isinstance(t.slice, ast.Constant)
                and t.slice.value in STATE_ATTRS
            ):
                found.append((node.lineno, f"assigns __dict__[{t.slice.value!r}]"))
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("setattr", "__setattr__") and len(node.args) >= 2:
                arg = node.args[1]
                if isinstance(arg, ast.Constant) and arg.value in STATE_ATTRS:
                    found.append((node.lineno, f"{name}(..., {arg.value!r}, ...)"))
            for kw in node.keywords:
                if kw.arg in STATE_ATTRS and name[:1].isupper():  # a record built in a given state
                    found.append((node.lineno, f"{name}({kw.arg}=...)"))
    return found


def test_the_scan_sees_every_form():
    code = """
job.state = RequestState.FAILED
peer.state, peer.error = PeerState.REJECTED, err
self.peer_state = PeerState.GONE
self._link.state: PeerState = PeerState.GONE
setattr(job, "state", RequestState.FAILED)
object.__setattr__(job, "state", RequestState.FAILED)
job.__dict__["state"] = RequestState.FAILED
Peer(b"i", "w", "inc", state=PeerState.ACCEPTED)
move(job, RequestState.FAILED)
x = job.state
job.status = "failed"
"""
    assert sorted(line for line, _ in state_assignments(ast.parse(code))) == [2, 3, 4, 5, 6, 7, 8, 9]


def test_only_lifecycle_assigns_lifecycle_states():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 30 and any(f.name == "prefill.py" for f in files)
    offenders = [
        f"{path.relative_to(SRC.parent)}:{line}: {what}"
        for path in files
        if path.resolve() not in ALLOWED
        for line, what in state_assignments(ast.parse(path.read_text(), str(path)))
    ]
    assert not offenders, "lifecycle states change only through protocol.lifecycle.move():\n" + "\n".join(offenders)
