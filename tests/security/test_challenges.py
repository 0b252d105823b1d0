"""The shm proof-of-ownership nonces a prefill issues (``shm_owner.Challenges``): single use, bound
to one claimant, expiring, bounded per connection (its oldest forgotten first) and in all (a new
one refused, none evicted)."""

from __future__ import annotations

import pytest

from pdstate.errors import InvalidEndpoint, PrefillBusy
from pdstate.transfer.engines import shm_owner
from pdstate.transfer.engines.shm_owner import MAX_CHALLENGES_PER_CLAIMANT, Challenges


def _refused(c: Challenges, nonce: bytes, claimant: str) -> None:
    with pytest.raises(InvalidEndpoint, match="register again for a fresh challenge"):
        c.redeem(nonce, claimant)


def test_a_nonce_is_redeemed_once_and_only_by_its_claimant():
    c = Challenges()
    a, b = c.issue("d/1"), c.issue("d/1")
    c.redeem(a, "d/1")
    _refused(c, a, "d/1")  # used
    _refused(c, b, "other/1")  # not issued to it: and now forgotten for its claimant too
    _refused(c, b, "d/1")
    assert len(c) == 0


def test_each_claimant_keeps_its_newest_nonces_only():
    c = Challenges()
    nonces = [c.issue("d/1") for _ in range(MAX_CHALLENGES_PER_CLAIMANT + 1)]
    other = c.issue("e/1")
    assert len(c) == MAX_CHALLENGES_PER_CLAIMANT + 1
    _refused(c, nonces[0], "d/1")  # the oldest went when the ninth was issued
    for n in nonces[1:]:
        c.redeem(n, "d/1")
    c.redeem(other, "e/1")  # another claimant's untouched
    assert len(c) == 0


def test_registers_on_other_connections_never_evict_a_pending_nonce():
    # the claimant's name is public: registers naming it used to evict its nonce (a lockout)
    c = Challenges()
    mine = c.issue("d/1", "conn-a")
    for i in range(10 * MAX_CHALLENGES_PER_CLAIMANT):
        c.issue("d/1", f"conn-{i % 3}")
    c.redeem(mine, "d/1")


def test_past_the_cap_new_nonces_are_refused_and_expired_ones_go(monkeypatch):
    monkeypatch.setattr(shm_owner, "MAX_CHALLENGES", 3)
    clock = [1000.0]
    monkeypatch.setattr(shm_owner.time, "monotonic", lambda: clock[0])
    c = Challenges()
    first, second, third = (c.issue(f"d{i}/1") for i in range(3))
    with pytest.raises(PrefillBusy, match="3 ownership challenges outstanding"):
        c.issue("d3/1")
    c.redeem(first, "d0/1")  # none was evicted
    c.redeem(second, "d1/1")
    clock[0] += shm_owner.CHALLENGE_TTL_S + 1
    _refused(c, third, "d2/1")  # expired
    assert len(c) == 0
    c.issue("d4/1")
    assert len(c) == 1
