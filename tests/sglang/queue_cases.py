"""The runs behind ``test_scheduler_queues.py``: SGLang's scheduler queues, two processes, per release.

``run`` takes the release's shared pair of children (``queue_pair``, fresh) and runs in it, in this
order: the same-config case with SGLang's Mooncake backend and with ``pdstate``, the refused
mismatches with each, and ``pdstate``'s lifecycle cases (abort, timeouts, rebootstrap, a decode or
a prefill stopped while a copy is in flight, 0.5.23's decode radix cache); SGLang's Mooncake
lifecycle runs in children of its own, on 0.5.23 alone.
SGLang's Mooncake backend fails rooms in a process that already holds managers of several
earlier cases (measured on 0.5.23: after its three same-config and mismatch cases, its radix-cache
case on unified KV ended Failed; after its lifecycle, the same-config case ended Failed, "it might
be dead"), which is why its cases go first and its lifecycle gets fresh children; the other
suites that share the pair (``test_rank_endpoints.py``, the bench's rank endpoints) run only
``pdstate`` and come after these runs (their fixtures request ``queue_runs``).
"""

from __future__ import annotations

import json
import time

from pdstate.devtools.sglang_pair.cases import CASES
from pdstate.integrations.sglang.receiver import ABORT_FENCE_S
from tests.sglang import runner

DEADLINE_S = 3.0  # per side and request: what bounds a hang
# pdstate's refusals never hang: a longer deadline costs nothing and keeps a loaded machine's slow
# refusal a refusal, not a timeout
OURS_DEADLINE_S = 10.0
# Wall-clock bounds (``tests.support.bounds``), each beside what it measured on a quiet machine:
# a refusal ends both sides this long after the request
FAIL_FAST_S, FAIL_FAST_QUIET_S = 5.0, 0.6
REFUSED = ("spec_vs_nospec", "c4_c128_order")
RUNS = [("mooncake", "correct"), ("pdstate", "correct")] + [
    (b, name) for b in ("pdstate", "mooncake") for name in REFUSED
]
# What SGLang's own Mooncake backend does with them through its queues (as with the managers
# called directly, ../shared/reference/sglang_cpu.md): Success with wrong bytes, except that 0.5.23
# refuses speculative vs not itself (``mooncake_checks_item_lens``).
MOONCAKE_REFUSES = {(r, "spec_vs_nospec") for r in runner.RELEASES if runner.row(r).mooncake_checks_item_lens}


# SGLang's Mooncake backend through the lifecycle cases is the control: what upstream does there
# beside pdstate. It runs on one release alone, the newest with every feature here (the decode radix
# cache, the deferred release of an aborted request): no test asserts a difference between the
# releases that only the control shows (0.5.19's release without deferral is asserted with pdstate).
MOONCAKE_LIFECYCLE = next(
    r for r in reversed(runner.RELEASES) if runner.row(r).speculative_radix_cache and runner.row(r).deferred_kv_release
)


def run(pair, release: str) -> dict:
    """``{(backend, case): result}`` of ``release``: every run in ``pair`` (the release's shared
    children, fresh: SGLang's Mooncake cases first), but SGLang's Mooncake lifecycle (children of its
    own, on ``MOONCAKE_LIFECYCLE`` alone)."""
    from pdstate.devtools.sglang_pair.pair import PDSTATE_ENGINE_ENV
    from pdstate.devtools.sglang_queues.pair import QueuePair

    results: dict = {
        (b, name): pair.run_case(CASES[name], b, deadline_s=OURS_DEADLINE_S if b == "pdstate" else DEADLINE_S)
        for b, name in RUNS
    }
    _lifecycle(pair, "pdstate", release, results)
    # SGLang's Mooncake backend in children of its own: observed here, in a process that already holds
    # managers of earlier cases its prefill reports some later rooms failed ("it might be dead")
    if release == MOONCAKE_LIFECYCLE:
        with runner.closing_together(QueuePair(runner.queue_env(release), extra_env=PDSTATE_ENGINE_ENV)) as own:
            _lifecycle(own, "mooncake", release, results)
    return results


def _lifecycle(pair, backend: str, release: str, results: dict) -> None:
    results[(backend, "features")] = _features(pair, backend)
    if runner.row(release).speculative_radix_cache:  # 0.5.19 refuses DSV4 with a decode radix cache at launch
        results[(backend, "prefix")] = _prefix(pair, backend)
        results[(backend, "prefix_unified")] = _prefix(pair, backend, unified=True)


WAITING_TIMEOUT_S, BOOTSTRAP_TIMEOUT_S = 3.0, 2.0
TIMEOUTS = {
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(int(WAITING_TIMEOUT_S)),  # an int setting on 0.5.19
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(int(BOOTSTRAP_TIMEOUT_S)),
}
# an abort's pages released this long after it (the abort call itself takes less): at once, not after
# a fence's or a timeout's seconds
RELEASE_S, RELEASE_QUIET_S = 1.0, 0.1
# SGLang's timeouts fire this long after their configured time (its queues' next poll)
TIMEOUT_LATE_S, TIMEOUT_LATE_QUIET_S = 1.0, 0.1
# A decode stalled (its whole process stopped) past SGLang's waiting timeout and the prefill's peer
# timeout (pdstate's default, set here), while the prefill's copy into it is held (Mooncake over TCP
# to a stopped process: it lands once the decode goes on)
STALL_PEER_TIMEOUT_S = 5.0
STALL_S = STALL_PEER_TIMEOUT_S + 1.0
STALL_SETTLE_S = 1.0  # watched after the release (the late bytes landed 36-69 ms after the resume)
PEER = {"PDSTATE_CONTROL__PEER_TIMEOUT_S": str(STALL_PEER_TIMEOUT_S)}
# A prefill stopped with its copy in flight, past SGLang's waiting timeout and the abort's fence
# (the decode's abort waits that long for the prefill's confirmation, then gives up)
PREFILL_STALL_S = WAITING_TIMEOUT_S + ABORT_FENCE_S + 1.0
# the prefill's forward: long enough that the decode surely stopped (``stall_after_s`` 0.1 after
# naming its destination, checked on its loop's turns) before the copy starts, on a busy host too;
# at 0.4 s, a decode loop late by 0.3 s let the whole copy land first (Success, no fault)
STALL_HOLD_S = 1.2
# the decode stopped meanwhile, so that the prefill's copy is still in flight when it stops
DECODE_HOLD_S = STALL_HOLD_S + 1.8
# its byte check comes no earlier than this long after the request (about 2 s after the prefill went
# on, whenever the pages were released: its late bytes landed 36-69 ms after it went on)
PREFILL_CHECK_AFTER_S = PREFILL_STALL_S + STALL_HOLD_S + 3.0


PREFIX_TOKENS, SUFFIX_TOKENS = 1024, 1100  # a cached 1,024-token turn, then the next turn's 1,100 tokens


def _prefix(pair, backend: str, unified: bool = False) -> dict:
    """0.5.23's decode radix cache: a first turn is cached by the decode's own tree when it
    finishes; the next turn (the same room, the same first tokens) is matched against it by
    SGLang's prealloc queue, which names only the pages past ``decode_prefix_len`` (``unified``:
    on unified-KV pools, the SWA window in per-slot rings)."""
    from dataclasses import replace

    from pdstate.devtools.sglang_pair.cases import BASE, Case

    side = replace(BASE, full_tokens=4096, swa_tokens=2048)  # room for the cached turn and the next
    if unified:  # its SWA room is a ring per request slot: a slot more for the radix cache's reserve
        side = replace(side, unified=True, max_num_reqs=3)
    out = pair.setup(Case("prefix", "a decode radix cache", side, side), backend, radix=True)
    if "setup_error" in out:
        return out
    out["first"] = pair.request(PREFIX_TOKENS, DEADLINE_S)
    out["next"] = pair.request(SUFFIX_TOKENS, DEADLINE_S, room=out["first"]["room"], decode={"keep_memory": True})
    out["full"] = pair.request(SUFFIX_TOKENS, DEADLINE_S)  # the same turn with nothing cached
    return out


class _PrefillHttp:
    """Stands for the prefill's HTTP server: records the ``/generate`` SGLang's rebootstrap POSTs."""

    def __init__(self) -> None:
        import http.server
        import threading

        from pdstate.devtools.sglang_pair.pair import free_port

        self.posts: list = []
        self.port = free_port()
        posts = self.posts

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                posts.append({"path": self.path, "json": json.loads(body)})
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, timeout_s: float = 5.0) -> dict | None:
        deadline = time.monotonic() + timeout_s
        while not self.posts and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.posts[0] if self.posts else None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _features(pair, backend: str) -> dict:
    """The lifecycle cases, one set of managers (SGLang's timeouts set) for all of them."""
    from pdstate.devtools.sglang_pair.cases import CORRECT

    http = _PrefillHttp()
    try:
        out = pair.setup(CORRECT, backend, env={**TIMEOUTS, **PEER}, http_port=http.port)
        if "setup_error" in out:
            return out
        _lifecycle_requests(pair, out, http)
        if backend == "pdstate":
            out["stalled"] = _stalled(pair)
            out["prefill_stalled"] = _prefill_stalled(pair)
    finally:
        http.close()
    return out


def _lifecycle_requests(pair, out: dict, http) -> None:
    from pdstate.devtools.sglang_pair.cases import CORRECT

    n = CORRECT.tokens[0]
    out["abort"] = pair.request(
        n, DEADLINE_S, prefill={"hold_s": 1.0}, decode={"abort_after_s": 0.2, "settle_s": 1.2}
    )  # the prefill sends after the abort: nothing of it may land
    out["resent_after_abort"] = pair.request(n, DEADLINE_S, room=out["abort"]["room"])
    # the stuck prefill sends only after the waiting timeout failed the request, however late (bounded)
    stuck_s = WAITING_TIMEOUT_S + TIMEOUT_LATE_S + 0.3
    out["waiting_timeout"] = pair.request(n, stuck_s + 1.7, prefill={"hold_s": stuck_s})
    out["bootstrap_timeout"] = pair.request(n, BOOTSTRAP_TIMEOUT_S + 1.5, decode=False)
    # a retracted request: it landed, then the decode dispatches the prefill's recompute through
    # SGLang's own rebootstrap (POST /generate to the prefill's registered HTTP port); the
    # prefill then sends the same room again, into the decode's fresh pages
    out["first_attempt"] = pair.request(n, DEADLINE_S, decode={"rebootstrap": True})
    post = http.wait()
    out["rebootstrap_post"] = post
    if post is not None:
        n_again = len(post["json"]["input_ids"])
        out["second_attempt"] = pair.request(n_again, DEADLINE_S, room=post["json"]["bootstrap_room"])


def _stalled(pair) -> dict:
    """The decode stops (SIGSTOP) just after naming its destination, before the prefill's forward
    ends; the prefill's copy into it is held meanwhile, the prefill gives the decode up, SGLang's
    waiting timeout passes; then the decode goes on and the queues release the request's pages
    whenever the receiver lets them: from then on nothing may land (``after_release_bytes``)."""
    from pdstate.devtools.sglang_pair.cases import CORRECT

    return pair.request(
        CORRECT.tokens[0], STALL_S + 10.0, prefill={"hold_s": STALL_HOLD_S},
        decode={"stall_after_s": 0.1, "stall_s": STALL_S, "settle_s": STALL_SETTLE_S},
    )  # fmt: skip


def _prefill_stalled(pair) -> dict:
    """The prefill's copy held in flight, then the prefill stopped (SIGSTOP): the decode stops just
    after naming its destination, for ``DECODE_HOLD_S``, so the prefill's Mooncake write (23 MB,
    more than the loopback socket buffers hold) cannot finish; half a second after its last chunk,
    with that write submitted and stuck, the prefill stops for ``PREFILL_STALL_S``. The decode goes
    on, SGLang's waiting timeout fails the request, and its abort finds no prefill to confirm it;
    then the prefill goes on and the rest of its copy lands: whenever the queues release the pages,
    nothing may land after (``after_release_bytes``)."""
    from pdstate.devtools.sglang_pair.cases import CORRECT

    return pair.request(
        CORRECT.tokens[0], PREFILL_STALL_S + STALL_HOLD_S + 10.0,
        prefill={"hold_s": STALL_HOLD_S, "stall_after_s": 0.5, "stall_s": PREFILL_STALL_S},
        decode={"stall_after_s": 0.1, "stall_s": DECODE_HOLD_S, "settle_s": STALL_SETTLE_S,
                "check_after_s": PREFILL_CHECK_AFTER_S},
    )  # fmt: skip
