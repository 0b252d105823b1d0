"""A new layout factor is one registry entry: a fake one, seen end to end.

The fake factor ``request_slots`` is registered (``pdstate.protocol.factors``), read from live pools
by a reader of its own (``pools.reporting.READERS``) and set in an SGLang launch by its ServerArgs
field (``--max-running-requests``). Nothing else is written for it, and yet: the fingerprint moves
with it, two agents whose reports differ only in it are refused at the handshake on both sides with
its fix line, and ``pdstate check`` names it with its fix in serve's words (config files) and in
SGLang's (launch lines).
"""

from __future__ import annotations

import logging

import pytest

from pdstate.agent import DecodeAgent, PrefillAgent, RequestState
from pdstate.errors import LayoutMismatch
from pdstate.pools import reporting
from pdstate.pools.reporting import build_report
from pdstate.protocol import factors
from pdstate.protocol.compat import compat_errors
from pdstate.protocol.report import diff
from tests.agent.support import make_side
from tests.support.preflight import run_check

FAKE = factors.Factor(
    "request_slots",
    "optional",
    "a fake factor for this test: the pools' request slots",
    launch="max_running_requests",
    fix=lambda p, d, _layouts=None: f"fix: set pool.max_num_reqs alike on both workers (prefill {p}, decode {d})",
    flag="--max-running-requests",
    sglang_fix=lambda p, d: f"set `--max-running-requests {p}` on the decode too (it has {d})",
    effect=lambda p, d: f"request slots {p} vs {d}: requests land in slots the other side does not have",
)
MESSAGE = (
    "DSV4 layout mismatch on request_slots: prefill server has request_slots=4, but decode server has "
    "request_slots=8. Both servers must build the same state layout."
)
FIX = "fix: set pool.max_num_reqs alike on both workers (prefill 4, decode 8)"


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(reporting.READERS, "request_slots", lambda _view, target, _draft: target.max_num_reqs)
    with factors.registered(FAKE):
        yield FAKE
    assert "request_slots" not in factors.FACTORS


def test_the_fingerprint_moves_with_the_new_factor_and_nothing_else_does(monkeypatch):
    side, other = make_side(False), make_side(False, max_num_reqs=8)
    try:
        plain = build_report(side.pools.target, side.pools.draft)[0]
        assert build_report(other.pools.target, other.pools.draft)[0].fingerprint == plain.fingerprint
        monkeypatch.setitem(reporting.READERS, "request_slots", lambda _view, target, _draft: target.max_num_reqs)
        with factors.registered(FAKE):
            four = build_report(side.pools.target, side.pools.draft)[0]
            eight = build_report(other.pools.target, other.pools.draft)[0]
        assert four.factors == (*plain.factors, ("request_slots", 4))
        assert len({plain.fingerprint, four.fingerprint, eight.fingerprint}) == 3
        with factors.registered(FAKE):
            assert four.value("request_slots") == 4 and eight.value("request_slots") == 8
            assert diff(four, eight) == [("request_slots", 4, 8)]
            assert [(e.type, e.message) for e in compat_errors(four, eight, "prefill")] == [("LayoutMismatch", MESSAGE)]
        assert diff(four, eight) == []  # a version without the factor does not compare it
    finally:
        side.close()
        other.close()


def test_two_agents_differing_only_in_it_are_refused_on_both_sides_with_its_fix(fake, caplog):
    p, d = make_side(False), make_side(False, max_num_reqs=8)
    caplog.set_level(logging.WARNING, logger="pdstate")
    pa = PrefillAgent(p.kv_args, (p.pools.target, p.pools.draft), engine="loopback")
    da = DecodeAgent(d.kv_args, (d.pools.target, d.pools.draft), engine="loopback")
    try:
        recv = da.receiver(pa.address, 7)
        assert recv.wait(10) is RequestState.FAILED
        err = recv.failure_exception()
        # rebuilt from the wire's class name and message, the error carries its factor and values
        assert type(err) is LayoutMismatch and str(err) == MESSAGE
        assert (err.factor, err.prefill, err.decode) == ("request_slots", 4, 8)
        assert da.prefills()[pa.address].reason == f"LayoutMismatch: {MESSAGE}"
    finally:
        da.close()
        pa.close()
        p.close()
        d.close()
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("handshake refused")]
    assert f"handshake refused peer={da.worker_id} factor=request_slots: LayoutMismatch: {MESSAGE}; {FIX}" in refusals
    assert f"handshake refused peer={pa.address} factor=request_slots: LayoutMismatch: {MESSAGE}; {FIX}" in refusals


def test_pdstate_check_names_it_with_the_fix_in_serves_words(fake, tmp_path, capsys):
    pre, dec = tmp_path / "p.toml", tmp_path / "d.toml"
    pre.write_text('role = "prefill"\npreset = "tiny"\n')
    dec.write_text('role = "decode"\npreset = "tiny"\n[pool]\nmax_num_reqs = 8\n')
    rc, _, err = run_check([str(pre), str(dec)], capsys)
    assert rc == 1
    assert err.splitlines() == [f"pair: LayoutMismatch: {MESSAGE}", f"  {FIX}"]


FLASH = "--model-path deepseek-ai/DeepSeek-V4-Flash --trust-remote-code"


def test_pdstate_check_sglang_names_it_with_the_fix_in_sglangs_words(fake, capsys):
    prefill = f"{FLASH} --disaggregation-mode prefill --max-running-requests 8"
    decode = f"{FLASH} --disaggregation-mode decode"
    rc, out, err = run_check(["--sglang", prefill, decode, "--sglang-version", "0.5.23"], capsys)
    lines = (out + err).splitlines()
    assert rc == 1, lines
    i = lines.index("- --max-running-requests: prefill 8, decode None")
    assert lines[i + 1 : i + 3] == [
        "  request_slots: 8 vs None -> request slots 8 vs None: requests land in slots the other side does not have",
        "  fix: set `--max-running-requests 8` on the decode too (it has None)",
    ]
    assert lines[-1] == (
        "pdstate's handshake refuses the pair with LayoutMismatch: DSV4 layout mismatch on request_slots: prefill "
        "server has request_slots=8, but decode server has request_slots=None. Both servers must build the same "
        "state layout."
    )
    both = decode.replace("decode", "decode --max-running-requests 8")
    rc, out, err = run_check(["--sglang", prefill, both, "--sglang-version", "0.5.23"], capsys)
    assert rc == 0 and (out + err).splitlines()[-1] == "compatible", out + err
