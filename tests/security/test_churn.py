"""Decode churn: a prefill releases every mapping and claim of a decode once it is gone (a new
incarnation registered, or its heartbeats stopped). It used to keep them all: four decode
restarts left 8 unlinked segments mapped in the prefill (+9 MB per restart with the tiny preset,
~780 MiB with dsv4-flash).

Real ``pdstate serve`` processes on 127.0.0.1 (port 0); the prefill's mappings are read from
``/proc/<pid>/maps``; every wait polls with a deadline.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import httpx

from tests.support.hostile import segment_paths
from tests.support.services import Services, ready, wait_for

# a live peer answers a heartbeat (every 0.2 s) well inside the timeout on a busy host
TIMERS = ["control.heartbeat_interval_s=0.2", "control.peer_timeout_s=3.0"]
RESTARTS = 4  # every combination: a restart of the same id after SIGKILL and after SIGTERM, two crashes in a row


def mapped_segments(pid: int) -> set[str]:
    """The ``/dev/shm/pdstate-*`` files process ``pid`` maps (unlinked ones included, by name)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return set(re.findall(r"(/dev/shm/pdstate-\S+)", maps))


def _transfer(http: httpx.Client, url: str) -> None:
    r = http.post(f"{url}/v1/transfers", json={"tokens": 300})
    assert r.status_code == 200 and r.json()["status"] == "success", r.text


def test_decode_restarts_leave_the_prefill_mapping_only_the_live_decode():
    with httpx.Client(timeout=30.0) as http, Services() as services:
        prefill, ctl = services.prefill(*TIMERS)
        for i in range(RESTARTS + 1):
            # the same worker id (a restarted pod) on even turns, a fresh one (a replacement) on odd
            wid = "churn" if i % 2 == 0 else f"churn-{i}"
            decode = services.start("decode", ["http.port=0", f"control.peer={ctl}", f"worker_id={wid}", *TIMERS])
            wait_for(lambda d=decode: ready(http, d.url), 60, f"decode {i} ready")
            _transfer(http, decode.url)
            live = set(segment_paths(decode.pid))
            assert live and live <= mapped_segments(prefill.pid)
            if i == RESTARTS:
                break
            if i % 3 == 2:
                decode.stop()  # SIGTERM: a clean exit
            else:
                os.kill(decode.pid, signal.SIGKILL)  # a crash: its segments stay until swept
                decode.wait()
        # the old decodes are released at the new incarnation or at their heartbeat timeout
        wait_for(lambda: mapped_segments(prefill.pid) == live or None, 30, "only the live decode mapped")
        assert len(mapped_segments(prefill.pid)) == len(live)
        r = http.get(f"{prefill.url}/v1/compat").json()
        assert [p["state"] for p in r["peers"]].count("accepted") == 1
