"""A token on one side only is an ``AuthError`` on both sides, named in ``/readyz``, the log and
``pdstate_auth_failures``, within the heartbeat timeout (it used to leave the decode "waiting for
the prefill ... to answer the handshake" forever, with nothing on the prefill).

Real ``pdstate serve`` processes on 127.0.0.1 (port 0); every wait polls with a deadline.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.support.api_source import SHM_TRANSPORT
from tests.support.bounds import within
from tests.support.services import Service, wait_for

TOKEN = "one-side-token-5be1c0d2"
TIMEOUT_S = 2.0
TIMERS = ["control.heartbeat_interval_s=0.2", f"control.peer_timeout_s={TIMEOUT_S}"]
# within the heartbeat timeout and a poll (tests.support.bounds; beside it, what that took on a quiet machine)
NAMED_S, NAMED_QUIET_S = TIMEOUT_S + 1.0, 0.2
FIX = (
    "give both workers the same secret: auth.token_file (or auth.token, PDSTATE_AUTH__TOKEN) on both, or on neither "
    "(then run both as one uid with the same auth.key_dir, or copy its key file to both)"
)


def _metric(http: httpx.Client, url: str, name: str) -> float:
    for row in http.get(f"{url}/metrics").text.splitlines():
        if row.startswith(name + " "):
            return float(row.split()[-1])
    raise AssertionError(f"no {name} in {url}/metrics")


KEYS_DIFFER = (
    "it does not hold this worker's control key (another auth token, a token on one side only, or without a token "
    "another uid or auth.key_dir)"
)


@pytest.mark.parametrize("side_with_token", ["prefill", "decode"])
def test_token_on_one_side_only_is_an_auth_error_on_both(side_with_token):
    """The two sides' CURVE keys differ (one from the token, one from the uid's key file): the
    handshake fails before any frame, and each side names it."""
    env = {"PDSTATE_AUTH__TOKEN": TOKEN}
    started: list[Service] = []
    try:
        prefill = Service(
            "prefill",
            ["http.port=0", "control.bind=tcp://127.0.0.1:0", *TIMERS],
            env if side_with_token == "prefill" else {},
        )
        started.append(prefill)
        ctl = prefill.wait_listening()["control"]
        decode = Service(
            "decode", ["http.port=0", f"control.peer={ctl}", *TIMERS], env if side_with_token == "decode" else {}
        )
        started.append(decode)
        decode.wait_listening()
        t0 = time.monotonic()
        with httpx.Client(timeout=10.0) as http:

            def refused():
                r = http.get(f"{decode.url}/readyz")
                body = r.json()
                return body if r.status_code == 503 and (body.get("error") or {}).get("type") == "AuthError" else None

            body = wait_for(refused, 30, "decode readyz names AuthError")
            # measured from the decode's listening event: its first handshake's failure, named at once
            within("an AuthError named in /readyz", time.monotonic() - t0, NAMED_S, NAMED_QUIET_S)
            said = f"prefill {ctl} failed the CURVE handshake (no detail): {KEYS_DIFFER}"
            prefill_sees = f"a decode's connection failed the CURVE handshake (zmtp_cryptographic): {KEYS_DIFFER}"
            assert body == {
                "ready": False,
                "reason": said,
                "check": "handshake",
                "error": {"type": "AuthError", "message": said, "fix": f"fix: {FIX}"},
                "transport": SHM_TRANSPORT,
            }
            r = http.get(f"{prefill.url}/readyz")
            assert r.status_code == 200  # a decode with the right token is still served
            assert r.json() == {
                "ready": True,
                "reason": f"decodes fail auth: {prefill_sees}",
                "check": "auth",
                "error": {"type": "AuthError", "message": prefill_sees, "fix": f"fix: {FIX}"},
                "transport": SHM_TRANSPORT,
            }
            assert _metric(http, prefill.url, "pdstate_auth_failures_total") >= 1
            assert _metric(http, decode.url, "pdstate_auth_failures_total") >= 1
        wait_for(lambda: f"AuthError: {prefill_sees}" in prefill.err(), 10, "the prefill's log line")
        wait_for(lambda: f"AuthError: {said}" in decode.err(), 10, "the decode's log")
    finally:
        for s in reversed(started):
            s.stop()
