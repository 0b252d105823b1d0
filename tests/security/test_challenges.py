"""The shm proof-of-ownership nonces a prefill issues (``shm_owner.Challenges``): single use, bound
to one claimant, expiring, and bounded per claimant and in all, the oldest forgotten first."""

from __future__ import annotations

import pytest

from pdstate.errors import InvalidEndpoint
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


def test_all_claimants_together_keep_the_newest_and_expired_ones_go(monkeypatch):
    monkeypatch.setattr(shm_owner, "MAX_CHALLENGES", 3)
    clock = [1000.0]
    monkeypatch.setattr(shm_owner.time, "monotonic", lambda: clock[0])
    c = Challenges()
    first, second, third = (c.issue(f"d{i}/1") for i in range(3))
    fourth = c.issue("d3/1")
    _refused(c, first, "d0/1")  # the oldest of all
    c.redeem(second, "d1/1")
    clock[0] += shm_owner.CHALLENGE_TTL_S + 1
    _refused(c, third, "d2/1")  # expired
    assert len(c) == 1
    c.issue("d4/1")  # forgets the expired one first
    assert len(c) == 1
    _refused(c, fourth, "d3/1")
