"""Moving a running request between two SGLang 0.5.23 decodes through their scheduler queues (the parent).

``MigrationTrio`` runs three children of ``migrate_side`` under one SGLang environment: a prefill,
decode A (the source) and decode B (the target), backend ``pdstate`` on all three. ``place``
brings a request in as the queue driver does (prefill → A through SGLang's queues, every byte
checked), puts it into A's running batch and runs decode steps on it; ``move`` moves it to B:

1. B's agent shakes hands with A's source agent (A judges B's layout as a prefill judges a
   decode); a refusal ends the move there, nothing paused, nothing allocated;
2. A pauses it (out of its running batch) and sends its rows and aux row; at once B's own
   ``DecodePreallocQueue`` allocates its rows and names them, and its transfer queue polls the
   migration receiver until the digests agree, then commits it (its boundary token from the aux
   row) into B's running batch;
3. A's and B's digests of every item of the request are compared, A releases its rows (its free
   pages counted, its memory watched after the release), then B runs a decode step on it.

``downtime_ms``: from the pause on A to the request in B's running batch (``time.monotonic``,
one clock for every process of a host). ``recompute`` is the control, SGLang's retraction with
recompute through the same queues: the request leaves A's running batch and its rows go back,
and the same room goes through the prefill's queues again (SGLang's rebootstrap: prompt and
output so far, prefilled and sent again) to a decode's running batch.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from pdstate.devtools.sglang_pair.cases import BASE, Side
from pdstate.devtools.sglang_pair.child import Child
from pdstate.devtools.sglang_pair.pair import child_env, env_dir, free_port

# Room for one request of 32k tokens on each side; the prefill's SWA pool too holds a whole prompt
# (the queues' prefill allocates a prompt's SWA slots for every token, ``alloc_extend``, as
# SGLang's prefill batch does), a decode's the window's pages (the SWA tail, as it preallocates).
MEASURE_SIDE = replace(BASE, full_tokens=34816, swa_tokens=4096)
MEASURE_PREFILL = replace(MEASURE_SIDE, swa_tokens=34816)
REPLY = "@@queues "
MODULE = "pdstate.devtools.sglang_queues.migrate_side"
STDERR_TAIL = 6000
SETUP_S = 120.0
SLACK_S = 60.0


def _ok(reply: dict, what: str) -> dict:
    if not reply.get("ok", False):
        raise RuntimeError(f"{what}: {reply.get('error')}\n{reply.get('trace')}")
    reply.pop("ok")
    return reply


class GenerateEndpoint:
    """The prefill's ``/generate`` as SGLang's rebootstrap reaches it (``submit_prefill_recompute``
    POSTs the retracted request there): each POST is recorded with its arrival time
    (``time.monotonic``) and answered at once; the driver then has the prefill child recompute."""

    def __init__(self) -> None:
        import queue
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.posts: queue.Queue = queue.Queue()
        posts = self.posts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                posts.put((time.monotonic(), self.path, json.loads(body or b"{}")))
                reply = b"{}"
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="generate-endpoint", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class MigrationTrio:
    """A prefill and two decodes (``a``, ``b``) of SGLang's scheduler queues, backend ``pdstate``."""

    def __init__(
        self,
        target: Path | None = None,
        extra_env: dict[str, str] | None = None,
        prefill: Child | None = None,
        a: Child | None = None,
    ) -> None:
        """Children of ``target``'s environment; ``prefill`` / ``a``: children of ``MODULE`` already
        running there (a ``QueuePair``'s), borrowed: ``close`` leaves them running."""
        env = child_env(target or env_dir(), extra_env)
        self.prefill = prefill or Child("prefill", env, MODULE, REPLY, STDERR_TAIL)
        self.a = a or Child("decode A", env, MODULE, REPLY, STDERR_TAIL)
        self.b = Child("decode B", env, MODULE, REPLY, STDERR_TAIL)
        self.owned = [c for c, given in ((self.prefill, prefill), (self.a, a)) if given is None] + [self.b]
        self.port = 0
        self.source = ""
        self.generate: GenerateEndpoint | None = None
        self.room = 9000

    def __enter__(self) -> MigrationTrio:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for child in self.owned:
            child.close()
        if self.generate is not None:
            self.generate.close()

    def setup(self, side: Side = BASE, target: Side | None = None, prefill: Side | None = None) -> dict:
        """A with ``side``'s pools, B with ``target``'s and the prefill with ``prefill``'s (default
        ``side``'s); A's source agent started. ``{"setup_s", "source"}``."""
        t0 = time.perf_counter()
        self.port = free_port()
        kw = dict(backend="pdstate", port=self.port)
        if self.generate is None:
            self.generate = GenerateEndpoint()
        prefill_kw = dict(side=(prefill or side).to_json(), http_port=self.generate.port, **kw)
        _ok(self.prefill.call("setup", SETUP_S, role="prefill", **prefill_kw), "prefill setup")
        self.a.tell("setup", role="decode", side=side.to_json(), **kw)
        self.b.tell("setup", role="decode", side=(target or side).to_json(), **kw)
        _ok(self.a.answer(SETUP_S), "decode A setup")
        _ok(self.b.answer(SETUP_S), "decode B setup")
        self.source = _ok(self.a.call("serve_source", SETUP_S), "A's source agent")["address"]
        return {"setup_s": time.perf_counter() - t0, "source": self.source}

    def setup_target(self, target: Side) -> dict:
        """B alone set up afresh with ``target``'s pools (A, its request and its agent kept)."""
        kw = dict(backend="pdstate", port=self.port)
        return _ok(self.b.call("setup", SETUP_S, role="decode", side=target.to_json(), **kw), "decode B setup")

    def place(self, tokens: int, steps: int, deadline_s: float = 30.0, keep_digests: bool = False) -> dict:
        """A request of ``tokens`` prompt tokens: prefill → A through the queues (byte-checked),
        into A's running batch, ``steps`` decode steps there. ``{"room", "arrival", "prompt",
        "output_ids", "seq_len"}``; ``keep_digests``: its items' digests as they arrived too
        (``arrived_items``: ``digests`` of the request before its decode steps)."""
        self.room += 1
        room = self.room
        kw = dict(room=room, tokens=tokens, deadline_s=deadline_s)
        self.prefill.tell("run_prefill", **kw)
        self.a.tell("run_decode", hold=True, **kw)
        pre = _ok(self.prefill.answer(deadline_s + SLACK_S), "prefill run")
        dec = _ok(self.a.answer(deadline_s + SLACK_S), "decode A run")
        if not (pre["outcome"] == dec["outcome"] == "Success" and dec["wrong_items"] == 0):
            raise RuntimeError(f"room {room} did not arrive on A whole: {pre} {dec}")
        adopted = _ok(self.a.call("adopt", SLACK_S, room=room), "adopt")
        arrived = _ok(self.a.call("digests", SLACK_S, room=room), "A digests") if keep_digests else None
        ran = _ok(self.a.call("steps", SLACK_S, room=room, n=steps), "decode steps")
        return {"room": room, "arrival": dec, "prompt": adopted["prompt"], "output_ids": ran["output_ids"],
                "first_output_ids": adopted["output_ids"], "seq_len": ran["seq_len"],
                "arrived_items": arrived and arrived["items"]}  # fmt: skip

    def move(
        self, placed: dict, deadline_s: float = 30.0, settle_s: float = 0.2, step_after: int = 1, watch: bool = True
    ) -> dict:
        """Move ``placed``'s request from A to B (the module's steps 1-3; ``watch=False``: A's memory
        after the release not watched, as when measuring)."""
        room = placed["room"]
        out: dict = {"room": room, "seq_len": placed["seq_len"]}
        hello = _ok(self.b.call("connect", SLACK_S, source=self.source, deadline_s=deadline_s), "connect")
        out["handshake"] = hello
        if hello["error"] is not None:
            out["outcome"] = "refused"
            out["source_view"] = _ok(self.a.call("source_view", SLACK_S), "source view")
            return out
        self.a.tell("migrate_out", room=room, deadline_s=deadline_s)
        self.b.tell("migrate_in", source=self.source, room=room, prompt=placed["prompt"],
                    output_ids=placed["output_ids"], deadline_s=deadline_s)  # fmt: skip
        src = _ok(self.a.answer(deadline_s + SLACK_S), "migrate_out")
        dst = _ok(self.b.answer(deadline_s + SLACK_S), "migrate_in")
        out.update(source=src, target=dst, outcome=dst["outcome"] if src["outcome"] == "SUCCESS" else src["outcome"])
        if out["outcome"] != "Success":
            return out
        out["downtime_ms"] = (dst["resumed_at"] - src["paused_at"]) * 1000
        a_items = _ok(self.a.call("digests", SLACK_S, room=room), "A digests")
        released = self.a.call("release", SLACK_S + settle_s, room=room, settle_s=settle_s, watch=watch)
        out["released"] = _ok(released, "A release")
        b_items = _ok(self.b.call("digests", SLACK_S, room=room), "B digests")
        out["items"] = len(a_items["items"])
        out["source_items"] = a_items["items"]
        out["by_kind"] = a_items["by_kind"]
        out["differing_items"] = sorted(
            k
            for k in set(a_items["items"]) | set(b_items["items"])
            if a_items["items"].get(k) != b_items["items"].get(k)
        )
        out["target_outside_bytes"] = b_items["outside_bytes"]
        out["target_output_ids"] = b_items["output_ids"]
        if step_after:
            out["after_step"] = _ok(self.b.call("steps", SLACK_S, room=room, n=step_after), "B step")
        return out

    def recompute(self, placed: dict, deadline_s: float = 30.0) -> dict:
        """The control: SGLang's retraction with recompute of ``placed``'s request on A, through
        the same queues. A retracts it and re-adds it (a rebootstrap); SGLang's
        ``submit_prefill_recompute`` POSTs it to the prefill's ``/generate`` (``GenerateEndpoint``);
        the prefill then prefills prompt and output so far (its forward: the driver's patterns, no
        model) and sends it through its queues to A, which commits it into its running batch.
        ``downtime_ms``: from the retraction to the request back in A's running batch."""
        room, seq_len = placed["room"], placed["seq_len"]
        self.a.tell("retract", room=room, deadline_s=deadline_s)
        try:
            posted_at, path, payload = self.generate.posts.get(timeout=deadline_s)
        except Exception:
            back = self.a.answer(deadline_s + SLACK_S)
            return {"outcome": "no /generate", "a": back}
        self.prefill.tell("run_prefill", room=room, tokens=seq_len, deadline_s=deadline_s)
        pre = _ok(self.prefill.answer(deadline_s + SLACK_S), "prefill recompute")
        back = _ok(self.a.answer(deadline_s + SLACK_S), "retract")
        out = {"room": room, "seq_len": seq_len, "prefill": pre, "a": back, "path": path,
               "payload_room": payload.get("bootstrap_room"), "outcome": back["outcome"]}  # fmt: skip
        if back["outcome"] == "Success":
            out["downtime_ms"] = (back["resumed_at"] - back["retracted_at"]) * 1000
            out["posted_ms"] = (posted_at - back["retracted_at"]) * 1000
            out["bytes"] = pre.get("bytes")
        return out

    def measure(self, sizes: tuple[int, ...], reps: int, steps: int = 2, deadline_s: float = 60.0) -> dict:
        """Per prompt size, ``reps`` migrations and ``reps`` retractions with recompute, interleaved
        (each on a request placed afresh; each ends finished, its rows released):
        ``{size: {"migrate": [...], "recompute": [...]}}``, each run's downtime and bytes."""
        out: dict = {}
        for n in sizes:
            runs: dict = {"migrate": [], "recompute": []}
            for _ in range(reps):
                m = self.move(self.place(n, steps, deadline_s), deadline_s, settle_s=0.0, step_after=0, watch=False)
                src = m.get("source", {})
                since = {
                    k: (src[k] - src["paused_at"]) * 1000 if src.get(k) else None for k in ("sent_at", "verified_at")
                }
                runs["migrate"].append({"outcome": m["outcome"], "downtime_ms": m.get("downtime_ms"),
                                        "named_ms": since["sent_at"], "verified_ms": since["verified_at"],
                                        "bytes": m.get("source", {}).get("bytes"), "seq_len": m["seq_len"],
                                        "equal": m.get("differing_items") == []})  # fmt: skip
                if m["outcome"] == "Success":
                    _ok(self.b.call("finish", deadline_s, room=m["room"]), "B finish")
                r = self.recompute(self.place(n, steps, deadline_s), deadline_s)
                runs["recompute"].append({"outcome": r["outcome"], "downtime_ms": r.get("downtime_ms"),
                                          "bytes": r.get("bytes"), "seq_len": r["seq_len"] if "seq_len" in r else None,
                                          "posted_ms": r.get("posted_ms")})  # fmt: skip
                if r["outcome"] == "Success":
                    _ok(self.a.call("finish", deadline_s, room=r["room"]), "A finish")
            out[n] = runs
        return out


def main() -> None:
    """``python -m pdstate.devtools.sglang_queues.migrate [TOKENS...] [--steps N]``: JSON results."""
    import argparse

    from pdstate.devtools.sglang_pair.pair import PDSTATE_ENGINE_ENV

    parser = argparse.ArgumentParser(prog="python -m pdstate.devtools.sglang_queues.migrate")
    parser.add_argument("tokens", type=int, nargs="*", default=[700])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--unlike", action="store_true", help="then B with pages of 512 tokens (refused)")
    parser.add_argument("--recompute", action="store_true", help="and SGLang's retraction with recompute of each")
    parser.add_argument(
        "--measure", type=int, default=0, metavar="REPS", help="downtime: REPS runs per size, bench pools"
    )
    a = parser.parse_args()
    with MigrationTrio(env_dir("0.5.23"), extra_env=PDSTATE_ENGINE_ENV) as trio:
        if a.measure:
            out = [trio.setup(MEASURE_SIDE, prefill=MEASURE_PREFILL), trio.measure(tuple(a.tokens), a.measure, a.steps)]
            print(json.dumps(out, default=str))
            return
        results = [trio.setup()]
        for n in a.tokens:
            results.append(trio.move(trio.place(n, a.steps)))
            if a.recompute:
                results.append(trio.recompute(trio.place(n, a.steps)))
        if a.unlike:
            results.append(trio.setup_target(replace(BASE, page_size=512)))
            placed = trio.place(a.tokens[0], a.steps)
            before = _ok(trio.a.call("digests", SLACK_S, room=placed["room"]), "A digests")
            moved = trio.move(placed)
            after = _ok(trio.a.call("digests", SLACK_S, room=placed["room"]), "A digests")
            moved["source_unchanged"] = before["items"] == after["items"]
            moved["still_runs"] = _ok(trio.a.call("steps", SLACK_S, room=placed["room"], n=1), "A step")
            results.append(moved)
    print(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
