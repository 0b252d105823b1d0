"""The parent of the scheduler-queue driver: a prefill child and a decode child (``side.py``'s
commands, served by ``migrate_side.py``, which adds a running request's migration: ``migrate``).

``QueuePair.run_case`` sets up both sides for a case (the prefill first: it starts the bootstrap
server on a free port), then runs each request on both sides at once; each side polls its queues
until the request leaves them or ``deadline_s`` passes, and answers. The answer per request: each
side's outcome (``Success``, ``Failed`` with SGLang's message, or ``timeout (<poll state>)``), the
decode's byte check, and the aux row compared across the two sides (SGLang writes it from the
request on the prefill, so it is compared as the prefill left it and as the decode read it).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from pdstate.devtools.sglang_pair.cases import Case
from pdstate.devtools.sglang_pair.child import Child, ChildPair
from pdstate.devtools.sglang_pair.pair import child_env, env_dir, free_port

REPLY = "@@queues "
SIDE_MODULE = (
    "pdstate.devtools.sglang_queues.migrate_side"  # what each child runs (``side``, and running requests moved)
)
STDERR_TAIL = 6000  # characters of a silent child's stderr in its error
SLACK_S = 30.0  # what a child may take beyond a request's deadline to answer (setup, byte checks)
SETUP_S = 120.0


def _side(reply: dict) -> dict:
    if not reply.get("ok", True):
        return {"outcome": "error", "failure": reply.get("error"), "trace": reply.get("trace")}
    reply.pop("ok", None)
    return reply


def _compare_aux(sent: list | None, dec: dict) -> None:
    """The aux row as the prefill left it against the row the decode read, counted in ``dec``."""
    landed = dec.pop("aux", None)
    if sent is not None and landed is not None:
        wrong_aux = sum(a != b for a, b in zip(sent, landed))
        dec["aux_items"] = len(sent)
        dec["wrong_items"] = dec.get("wrong_items", 0) + wrong_aux
        dec.setdefault("wrong_by", {})["aux"] = wrong_aux


def _rank(n: int, i: int) -> dict:
    """Decode rank ``i`` of ``n``'s setup options (none for a decode of one rank)."""
    return {"attn_tp": [n, i]} if n > 1 else {}


def _stage(n: int, i: int) -> dict:
    """Prefill stage ``i`` of ``n``'s setup options (none for a prefill of one stage)."""
    return {"pp": [n, i]} if n > 1 else {}


class QueuePair(ChildPair):
    """A prefill child and a decode child under the SGLang environment ``target``; with
    ``decode_ranks`` above 1, that many decode children, the attention-TP ranks of one decode
    (each request runs on all of them; ``decode`` is rank 0's answer, ``decode_ranks`` all); with
    ``prefill_stages`` above 1, that many prefill children, the PP stages of one prefill (each with
    its layers' pools; the first runs the bootstrap server; ``prefill`` is the first's answer,
    ``prefill_stages`` all, the time to Success the last stage's)."""

    def __init__(
        self,
        target: Path | None = None,
        extra_env: dict[str, str] | None = None,
        decode_ranks: int = 1,
        prefill_stages: int = 1,
    ) -> None:
        env = child_env(target or env_dir(), extra_env)
        super().__init__(env, SIDE_MODULE, REPLY, STDERR_TAIL)
        self.decodes = [self.decode] + [
            Child(f"decode rank {i}", env, SIDE_MODULE, REPLY, STDERR_TAIL) for i in range(1, decode_ranks)
        ]
        self.prefills = [self.prefill] + [
            Child(f"prefill stage {i}", env, SIDE_MODULE, REPLY, STDERR_TAIL) for i in range(1, prefill_stages)
        ]
        self.room = 5000

    def close(self) -> None:
        super().close()
        for child in self.decodes[1:] + self.prefills[1:]:
            child.close()

    def request(
        self,
        tokens: int,
        deadline_s: float,
        prefill: dict | None = None,
        decode: dict | bool | None = None,
        room: int | None = None,
    ) -> dict:
        """One request on both sides at once (``decode=False``: on the prefill alone, no decode asks
        for it); ``prefill`` / ``decode``: the sides' run options (``side.run_prefill`` /
        ``side.run_decode``); ``room``: a room used before (a request sent again), else a new one."""
        if room is None:
            self.room += 1
            room = self.room
        t0 = time.perf_counter()
        kw = dict(room=room, tokens=tokens, deadline_s=deadline_s)
        for child in self.prefills:
            child.tell("run_prefill", **kw, **(prefill or {}))
        decodes = self.decodes if decode is not False else []
        for child in decodes:
            child.tell("run_decode", **kw, **(decode or {}))
        wait = deadline_s + SLACK_S + (decode or {}).get("settle_s", 0.0) if decode is not False else 0.0
        stages = [_side(child.answer(deadline_s + SLACK_S)) for child in self.prefills]
        ranks = [_side(child.answer(wait)) for child in decodes] or [{"outcome": "not run"}]
        elapsed = time.perf_counter() - t0
        pre, sent = stages[0], stages[-1].get("aux")
        for stage in stages:
            stage.pop("aux", None)
        for dec in ranks:
            _compare_aux(sent, dec)
        times = [stage.pop("ms", None) for stage in stages]
        out = {
            "tokens": tokens, "room": room, "prefill": pre, "decode": ranks[0],
            "send_to_success_ms": None if None in times else max(times), "elapsed_s": elapsed,
        }  # fmt: skip
        if len(ranks) > 1:
            out["decode_ranks"] = ranks
        if len(stages) > 1:
            out["prefill_stages"] = stages
        return out

    def setup(
        self,
        case: Case,
        backend: str,
        env: dict | None = None,
        radix: bool = False,
        http_port: int | None = None,
        role_env: dict[str, dict] | None = None,
    ) -> dict:
        """Both sides set up for ``case`` (``env``: SGLang settings both managers read, e.g.
        ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``; ``role_env``: more, by role, e.g. each side's
        ``PDSTATE_HTTP__PORT``); ``{"setup_s"}``, plus ``setup_error`` on failure."""
        port = free_port()
        t0 = time.perf_counter()
        kw = dict(backend=backend, port=port, radix=radix, http_port=http_port)
        envs = {role: {**(env or {}), **(role_env or {}).get(role, {})} for role in ("prefill", "decode")}
        n = len(self.prefills)
        p = self.prefill.call(
            "setup", SETUP_S, role="prefill", side=case.prefill.to_json(), env=envs["prefill"], **kw, **_stage(n, 0)
        )
        for i, child in enumerate(self.prefills[1:], 1):  # the bootstrap server (stage 0's) runs first
            if p["ok"]:
                p = child.call(
                    "setup",
                    SETUP_S,
                    role="prefill",
                    side=case.prefill.to_json(),
                    env=envs["prefill"],
                    **kw,
                    **_stage(n, i),
                )
        d = {"ok": False, "error": "not set up (the prefill's setup failed)"}
        if p["ok"]:
            n = len(self.decodes)
            for i, child in enumerate(self.decodes):
                child.tell("setup", role="decode", side=case.decode.to_json(), env=envs["decode"], **kw, **_rank(n, i))
            answers = [child.answer(SETUP_S) for child in self.decodes]
            d = next((a for a in answers if not a["ok"]), answers[0])
        out = {"setup_s": time.perf_counter() - t0}
        if not (p["ok"] and d["ok"]):
            out["setup_error"] = p.get("error") or d.get("error")
            out["setup_trace"] = p.get("trace") or d.get("trace")
        return out

    def run_case(self, case: Case, backend: str, tokens: tuple[int, ...] | None = None, deadline_s: float = 3.0):
        out = {"case": case.name, "what": case.what, "backend": backend, "deadline_s": deadline_s}
        out.update(self.setup(case, backend))
        out["requests"] = [] if "setup_error" in out else [self.request(n, deadline_s) for n in (tokens or case.tokens)]
        return out


def main() -> None:
    """``python -m pdstate.devtools.sglang_queues.pair BACKEND CASE... [--decode-ranks N]
    [--prefill-stages N]``: JSON results on stdout (``--decode-ranks``: a decode of that many
    attention-TP ranks; ``--prefill-stages``: a prefill of that many PP stages)."""
    import argparse

    from pdstate.devtools.sglang_pair.cases import QUEUE_CASES
    from pdstate.devtools.sglang_pair.pair import PDSTATE_ENGINE_ENV

    parser = argparse.ArgumentParser(prog="python -m pdstate.devtools.sglang_queues.pair")
    parser.add_argument("backend")
    parser.add_argument("cases", nargs="*", default=["correct"])
    parser.add_argument("--decode-ranks", type=int, default=1)
    parser.add_argument("--prefill-stages", type=int, default=1)
    a = parser.parse_args()
    with QueuePair(extra_env=PDSTATE_ENGINE_ENV, decode_ranks=a.decode_ranks, prefill_stages=a.prefill_stages) as pair:
        results = [pair.run_case(QUEUE_CASES[n], a.backend) for n in a.cases]
    print(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
