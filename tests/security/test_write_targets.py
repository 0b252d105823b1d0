"""Write targets: whatever a decode says about its own memory cannot direct a write elsewhere.

A prefill process serves a real victim decode process; a hostile decode (a raw DEALER with its
own shm pools, ``tests.support.hostile``) registers with forged endpoint fields and sends
transfer requests. Each forgery is refused before any byte moves, the victim's segments are
byte-identical afterwards (sentinel check over the files), the prefill keeps serving and the
victim's transfers keep verifying.
"""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdstate.protocol import wire
from tests.support.hostile import (
    RawDealer,
    RawDecode,
    changed_bytes,
    segment_image,
    segment_paths,
    with_paths,
    with_region,
)
from tests.support.workers import Workers, assert_all_verified, first_event, run_batch

_PROPERTY = dict(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture
def pair():
    """A prefill and a ready victim decode (real processes), and the victim's segment files."""
    with Workers() as ws:
        prefill, endpoint = ws.prefill()
        victim = ws.decode(endpoint, worker_id="victim")
        assert first_event(victim)["event"] == "ready"
        paths = segment_paths(victim.pid)
        assert paths, "the victim decode has no shm segments"
        yield prefill, endpoint, victim, paths


def _victim_path(victim_paths: list[str]):
    by_suffix = {p.rsplit("-", 1)[1]: p for p in victim_paths}
    return lambda own: by_suffix[own.rsplit("-", 1)[1]]


def _died_within(w, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if w.returncode is not None:
            return w.returncode
        time.sleep(0.05)
    return None


def _alive(prefill, victim) -> None:
    assert prefill.returncode is None, prefill.stderr_text()
    results, _ = run_batch(victim, [300, 1000])
    assert_all_verified(results, [300, 1000])


def test_a_register_naming_another_decodes_segments_is_refused(pair):
    prefill, endpoint, victim, victim_paths = pair
    attacker = RawDecode()
    dealer = RawDealer(endpoint)
    try:
        before = segment_image(victim_paths)
        forged = with_paths(attacker.endpoint, _victim_path(victim_paths))
        answer = attacker.handshake(dealer, forged)
        if isinstance(answer, wire.Accept):  # the old behaviour: then the request writes into the victim
            done = dealer.ask(attacker.request(1, 1000))
            assert changed_bytes(before, segment_image(victim_paths)) == 0, done
        assert isinstance(answer, wire.Reject), answer
        assert answer.error.type == "InvalidEndpoint"
        assert "does not belong to the registering decode" in answer.error.message
        assert changed_bytes(before, segment_image(victim_paths)) == 0
        _alive(prefill, victim)
    finally:
        dealer.close()
        attacker.close()


@pytest.mark.parametrize(
    "fields, phrase",
    [
        ({"file_offset": -(1 << 30)}, "file_offset -1073741824 is negative"),
        ({"file_offset": -4096}, "file_offset -4096 is negative"),
        ({"file_offset": 1 << 62}, "needs"),
        ({"nbytes": 1 << 40}, "overlap"),
    ],
)
def test_a_register_with_an_impossible_file_range_is_refused(pair, fields, phrase):
    prefill, endpoint, victim, victim_paths = pair
    attacker = RawDecode()
    dealer = RawDealer(endpoint)
    try:
        before = segment_image(victim_paths)
        answer = attacker.handshake(dealer, with_region(attacker.endpoint, 0, **fields))
        if isinstance(answer, wire.Accept):  # the old behaviour: the request's copy runs off the mapping
            dealer.send(attacker.request(1, 1000))
            dead = _died_within(prefill, 5.0)
            assert dead is None, f"the prefill died: exit status {dead}"
        assert isinstance(answer, wire.Reject), answer
        assert phrase in answer.error.message, answer.error.message
        assert changed_bytes(before, segment_image(victim_paths)) == 0
        _alive(prefill, victim)
    finally:
        dealer.close()
        attacker.close()
        assert os.path.exists(victim_paths[0])


def _victim_register(victim) -> wire.Register:
    return wire.decode(bytes.fromhex(victim.command({"cmd": "describe"}, "describe")["register"]))


@pytest.mark.parametrize(
    "forgery", ["owner_pid", "owner_pid_stolen", "engine_id", "whole_endpoint", "whole_endpoint_stolen", "kv_outside"]
)
def test_forged_ownership_is_refused_and_the_victim_keeps_working(pair, forgery):
    """The victim's pid claimed as the attacker's, the victim's engine id, the victim's whole
    endpoint, buffers outside the attacker's regions: each refused, the victim untouched. Without
    the victim's segment secrets the proof of ownership fails; a process of the victim's uid that
    reads them (``_stolen``: the documented trust boundary) still cannot take segments another
    live decode has claimed."""
    prefill, endpoint, victim, victim_paths = pair
    theirs = _victim_register(victim)
    attacker = RawDecode()
    dealer = RawDealer(endpoint)
    try:
        before = segment_image(victim_paths)
        ep, kv, steal = attacker.endpoint, None, forgery.endswith("_stolen")
        unproven = "does not belong to the registering decode: its proof of ownership does not match"
        if forgery.startswith("owner_pid"):
            ep = {**with_paths(ep, _victim_path(victim_paths)), "owner_pid": theirs.engine.endpoint["owner_pid"]}
            phrase = "it is mapped for another live decode" if steal else unproven
        elif forgery == "engine_id":
            ep = {**ep, "engine_id": theirs.engine.endpoint["engine_id"]}
            phrase = "it is connected for another live decode"
        elif forgery.startswith("whole_endpoint"):
            ep = theirs.engine.endpoint
            phrase = "it is connected for another live decode" if steal else unproven
        else:
            kv = theirs.kv  # the victim's addresses: not inside any region the attacker published
            phrase = "is outside every region decode attacker published to its transfer engine"
        answer = attacker.handshake(dealer, ep, steal=steal, kv=kv)
        assert isinstance(answer, wire.Reject), answer
        assert phrase in answer.error.message, answer.error.message
        refused = dealer.ask(attacker.request(1, 1000))
        assert isinstance(refused, wire.Error) and refused.error.type == "NotRegistered", refused
        assert changed_bytes(before, segment_image(victim_paths)) == 0
        _alive(prefill, victim)
    finally:
        dealer.close()
        attacker.close()


PROPERTY_EXAMPLES = 60


def _draw_endpoint(data, attacker: RawDecode, theirs: wire.Register, victim_paths: list[str]) -> dict:
    """The attacker's endpoint with hostile values drawn for any of its fields."""
    ep = dict(attacker.endpoint)
    if data.draw(st.integers(0, 2), label="forge the endpoint") == 0:
        return ep  # a third of the examples: the attacker's own endpoint, then hostile requests
    regions = [dict(r) for r in ep["regions"]]
    ints = st.one_of(
        st.integers(-(1 << 63), (1 << 64) - 1), st.integers(-(1 << 20), 1 << 24), st.sampled_from([0, -1, 4096, -4096])
    )
    for r in regions:
        if data.draw(st.integers(0, 3), label="forge path") == 3:
            r["path"] = data.draw(
                st.sampled_from([*victim_paths, "/dev/shm/pdstate-1-0123456789abcdef-x", "/etc/passwd", "/dev/shm"])
            )
        for key in ("file_offset", "nbytes", "base_ptr"):
            if data.draw(st.integers(0, 3), label=f"forge {key}") == 3:
                r[key] = data.draw(ints, label=key)
    ep["regions"] = regions
    if data.draw(st.integers(0, 3), label="forge owner_pid") == 3:
        ep["owner_pid"] = data.draw(st.sampled_from([theirs.engine.endpoint["owner_pid"], 1, -1, 0]))
    if data.draw(st.integers(0, 3), label="forge engine_id") == 3:
        ep["engine_id"] = theirs.engine.endpoint["engine_id"]
    return ep


def _draw_kv(data, attacker: RawDecode, theirs: wire.Register) -> wire.KVDesc:
    kv = wire.KVDesc.of(attacker.kv_args)
    how = data.draw(st.sampled_from(["own"] * 6 + ["victim", "shifted", "grown"]), label="kv")
    if how == "victim":
        return theirs.kv
    if how == "own":
        return kv
    delta = data.draw(st.integers(-(1 << 24), 1 << 24), label="delta")
    ptrs = list(kv.kv_data_ptrs)
    lens = list(kv.kv_data_lens)
    i = data.draw(st.integers(0, len(ptrs) - 1), label="buffer")
    if how == "shifted":
        ptrs[i] = max(1, ptrs[i] + delta)
    else:
        lens[i] = max(1, lens[i] + abs(delta))
    return kv.model_copy(update={"kv_data_ptrs": ptrs, "kv_data_lens": lens})


def test_hostile_endpoints_never_change_a_byte_outside_the_attackers_memory(pair):
    """Property: whatever a registered decode forges in its endpoint and KVDesc, followed by
    valid and fuzzed requests, no byte of the other decode's segments changes and the prefill
    answers every time."""
    prefill, endpoint, victim, victim_paths = pair
    theirs = _victim_register(victim)
    attacker = RawDecode()
    before = segment_image(victim_paths)
    counts = {"accepted": 0, "rejected": 0, "requests": 0}

    # one connection throughout: a ZeroMQ identity is bound to its first connection, and a
    # re-register from the same connection replaces that connection's earlier registration
    dealer = RawDealer(endpoint)

    @settings(max_examples=PROPERTY_EXAMPLES, **_PROPERTY)
    @given(st.data())
    def hostile(data):
        attacker.incarnation = data.draw(st.sampled_from(["a" * 16, "a" * 16, "a" * 16, "b" * 16]), label="incarnation")
        ep, kv = _draw_endpoint(data, attacker, theirs, victim_paths), _draw_kv(data, attacker, theirs)
        answer = attacker.handshake(dealer, ep, kv=kv)
        counts["accepted" if isinstance(answer, wire.Accept) else "rejected"] += 1
        for room in range(data.draw(st.integers(1, 3), label="requests")):
            req = attacker.request(room, data.draw(st.sampled_from([1, 300, 1000]), label="seq_len"))
            if data.draw(st.booleans(), label="fuzz indices"):
                pages = data.draw(st.lists(st.integers(-(1 << 40), 1 << 40), max_size=8), label="pages")
                req = req.model_copy(update={"dst_kv_pages": wire.PackedIndices.pack(pages)})
            attacker.settle(dealer, dealer.ask(req))
            counts["requests"] += 1
        assert prefill.returncode is None, prefill.stderr_text()
        assert changed_bytes(before, segment_image(victim_paths)) == 0

    try:
        hostile()
    finally:
        dealer.close()
        attacker.close()
    print(f"hostile endpoints: {counts}, victim bytes changed: 0, prefill alive")
    assert counts["rejected"] > 0 and counts["accepted"] > 0
    _alive(prefill, victim)
