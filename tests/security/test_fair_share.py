"""Fair share: a registered decode that never sends its verdicts cannot starve another decode of
the prefill. It holds at most ``control.decode_share`` of the prefill's tokens and request slots
(past that it is refused ``PrefillBusy`` at once), each verdict is awaited
``control.verdict_timeout_s`` (default 5 s, was the 30 s request deadline), and after three
withheld in a row it is dropped with the reason, shown on the prefill's ``/readyz`` and in
``pdstate_decodes_dropped_total``. Another decode's requests keep their normal time throughout.

It used to be: eight requests from one such decode held the prefill's pages for 30 s, another
decode's transfer failed "deadline exceeded", and every ``/readyz`` said 200.

Real ``pdstate serve`` processes on 127.0.0.1 (port 0) and a raw ZeroMQ decode; every wait polls
with a deadline.
"""

from __future__ import annotations

import time

import httpx

from pdstate.protocol import wire
from pdstate.protocol.report import ErrorInfo
from tests.support.hostile import RawDealer, RawDecode
from tests.support.services import Service, ready, wait_for

VERDICT_S = 2.0
TIMERS = ["control.heartbeat_interval_s=0.2", "control.peer_timeout_s=60"]  # the raw decode sends no heartbeats


def _transfer(http: httpx.Client, url: str) -> float:
    t0 = time.monotonic()
    r = http.post(f"{url}/v1/transfers", json={"tokens": 100})  # tiny: 256 of its 512 SWA tokens
    assert r.status_code == 200 and r.json()["status"] == "success", r.text
    return time.monotonic() - t0


def _dones(dealer: RawDealer, n: int) -> dict[int, wire.TransferDone]:
    """The next ``n`` ``TransferDone`` frames, by room."""
    dones: dict[int, wire.TransferDone] = {}
    while len(dones) < n:
        done = dealer.read_until(lambda m: isinstance(m, wire.TransferDone), 20)[-1]
        dones[done.room] = done
    return dones


def test_a_decode_withholding_verdicts_does_not_delay_another():
    started: list[Service] = []
    withholder = RawDecode(worker_id="withholder")
    dealer = None
    with httpx.Client(timeout=60.0) as http:
        try:
            prefill = Service(
                "prefill",
                [
                    "http.port=0",
                    "control.bind=tcp://127.0.0.1:0",
                    f"control.verdict_timeout_s={VERDICT_S}",
                    "transfer.verify=off",  # the raw decode asks for no digest
                    *TIMERS,
                ],
            )
            started.append(prefill)
            ctl = prefill.wait_listening()["control"]
            decode = Service("decode", ["http.port=0", f"control.peer={ctl}", *TIMERS])
            started.append(decode)
            wait_for(lambda: ready(http, decode.url), 60, "decode ready")
            normal = max(_transfer(http, decode.url) for _ in range(3))

            dealer = RawDealer(ctl, f"withholder/{withholder.incarnation}".encode())
            assert isinstance(withholder.handshake(dealer), wire.Accept)
            for room in (1001, 1002, 1003, 1004):  # tiny: 1024 full and 512 SWA tokens, 5 request slots
                dealer.send(withholder.request(room, 128))
            dones = _dones(dealer, 4)
            held = sorted(r for r, d in dones.items() if d.status == "success")
            busy = [dones[r].error for r in dones if r not in held]
            assert len(held) == 1 and len(busy) == 3, dones  # its share: half of tiny's 512 SWA tokens
            assert {b.type for b in busy} == {"PrefillBusy"}
            assert busy[0].message.startswith("decode withholder would hold ")
            assert busy[0].message.endswith("(control.decode_share 0.5)")
            # no verdict for those held (their pages held): the other decode runs at its normal time
            took = [_transfer(http, decode.url) for _ in range(3)]
            assert max(took) < max(2 * normal, normal + 1.0) and max(took) < VERDICT_S, (normal, took)

            # each withheld verdict fails its request after VERDICT_S; the third in a row drops the decode
            pending, failed, room = list(held), 0, 1005
            while failed < 3:
                done = dealer.read_until(lambda m: isinstance(m, wire.TransferDone) and m.room in pending, 10)[-1]
                pending.remove(done.room)
                failed += 1
                assert done.status == "failed" and done.error == ErrorInfo(
                    type="TransferFailed",
                    message=f"room {done.room}: decode withholder sent no verdict within {VERDICT_S:g} s "
                    "(verdict_timeout_s)",
                )
                if failed + len(pending) < 3:  # another request, its verdict withheld too
                    dealer.send(withholder.request(room, 100))
                    got = dealer.read_until(lambda m, r=room: isinstance(m, wire.TransferDone) and m.room == r, 10)
                    assert got[-1].status == "success", got[-1]
                    pending.append(room)
                    room += 1
            why = (
                f"decode withholder withheld its verdict on 3 requests in a row (verdict_timeout_s {VERDICT_S:g} s): "
                "dropped"
            )

            def dropped():
                r = http.get(f"{prefill.url}/readyz")
                return r.json() if r.json().get("check") == "fair_share" else None

            body = wait_for(dropped, 15, "the prefill's readyz names the drop")
            assert body["ready"] is True and body["reason"] == f"a decode was dropped: {why}"
            assert body["error"]["type"] == "PeerGone" and body["error"]["message"] == why
            metrics = http.get(f"{prefill.url}/metrics").text
            assert "pdstate_decodes_dropped_total 1.0" in metrics
            answer = dealer.ask(wire.Heartbeat(worker_id="withholder", incarnation=withholder.incarnation, seq=1))
            assert isinstance(answer, wire.Error) and answer.error.type == "NotRegistered"
            assert _transfer(http, decode.url) < max(2 * normal, normal + 1.0)
        finally:
            if dealer is not None:
                dealer.close()
            withholder.close()
            for s in reversed(started):
                s.stop()
