"""No byte after release: a page a prefill was told it may write goes back to the decode's free
pool only once that prefill confirmed nothing more of its request lands, or is proven gone.

The prefill's copies are held up in its engine (``copy_delay_s``: each copy starts that long after
its submit, on the prefill's I/O thread, as a stalled or slow prefill's would), the decode is
frozen past its request deadline meanwhile, and then thawed: it sees its prefill silent and fails
the requests at once, but keeps their pages quarantined until the prefill, awake again, confirms.
Byte images of the decode's shared-memory segments (read by this process) taken at every release
show that nothing changes after it.
"""

from __future__ import annotations

import signal
import time

import numpy as np

from tests.support.faults import FAULT
from tests.support.pools import ROOMY
from tests.support.waiting import wait_until
from tests.support.workers import (
    collect_batch,
    first_event,
    kill,
    prefill_requests,
    segments,
    start_batch,
    wait_decode,
)

COPY_DELAY_S = 2.0
LENGTHS = [300, 1000]


def _image(pid: int) -> dict[str, np.ndarray]:
    out = {}
    for path in segments(pid):
        with open(path, "rb") as f:
            out[path] = np.frombuffer(f.read(), dtype=np.uint8)
    return out


def _changed(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> int:
    return sum(int((a[k] != b[k]).sum()) for k in a if k in b)


def test_decode_frozen_past_deadline_while_the_prefill_holds_copies(workers):
    fault = dict(FAULT, request_deadline_s=2.0)
    p, ep = workers.prefill(ROOMY, engine_options={"copy_delay_s": COPY_DELAY_S}, **fault)
    d = workers.decode(ep, ROOMY, worker_id="sleeper", **fault)
    free0 = first_event(d)["free"]
    before = _image(d.pid)
    start_batch(d, LENGTHS, concurrency=len(LENGTHS))
    wait_until("the first copy held", lambda: len(prefill_requests(p)["in_flight"]) >= 1, 10)
    t_stop = kill(d, signal.SIGSTOP)
    try:  # frozen past its deadline, while the prefill's first copy is still held
        wait_until("past the decode's deadline", lambda: time.monotonic() - t_stop > 2.5, 10)
    finally:
        kill(d, signal.SIGCONT)
    results, done, _ = collect_batch(d)
    assert "failed" in [r["status"] for r in results], results  # (one may verify: the freeze's timing)
    # the prefill, still copying, confirms each request once its copy is done: only then are the
    # pages the decode's again; no byte of any request lands after that

    s = wait_decode(d, "the pages back", lambda s: s["free"] == free0 and s["quarantined"] == 0, 60)
    released = _image(d.pid)
    assert _changed(before, released) > 0  # the held copies did land (while the pages were held)
    wait_until("the prefill idle", lambda: not prefill_requests(p)["in_flight"], 60)
    assert _changed(released, _image(d.pid)) == 0
    assert s["quarantined"] == 0
