"""A prefill agent as a child process for the agent tests.

argv[1]: JSON options ``{"seed", "bad_pair"?, "aux"?, "engine"?, "engine_options"?, "device"?}``. Prints ``{"address", "pid"}``,
then answers one JSON line per command line on stdin until EOF:
``{"op": "sender", "room", "num_pages", "aux_index"?}``, ``{"op": "send", "room", "pages", "state"?}``,
``{"op": "wait", "room", "timeout"}``, ``{"op": "abort", "room", "reason"}``, ``{"op": "decodes"}``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdstate.agent import PrefillAgent
from tests.agent.support import fill, make_side


def main() -> None:
    opts = json.loads(sys.argv[1])
    bad = bool(opts.get("bad_pair"))
    changes = dict(opts.get("settings", {}), **({"draft_mapping": "clone"} if bad else {}))
    device = opts.get("device", "cpu")
    side = make_side(
        False, opts.get("preset", "tiny"), check=not bad, aux=opts.get("aux", True), device=device, **changes
    )
    fill(side.kv_args, opts["seed"], device)
    agent = PrefillAgent(
        side.kv_args,
        (side.pools.target, side.pools.draft),
        engine=opts.get("engine", "shm"),
        engine_options={"segment_dir": opts["segment_dir"]}
        if opts.get("engine", "shm") == "shm"
        else opts.get("engine_options"),
        worker_id=opts.get("worker_id", "prefill"),
        check_local=not bad,
        bind=opts.get("bind", "tcp://127.0.0.1:0"),
    )
    print(json.dumps({"address": agent.address, "pid": os.getpid()}), flush=True)
    senders = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op, out = cmd["op"], {}
        try:
            if op == "sender":
                senders[cmd["room"]] = agent.sender(cmd["room"], cmd["num_pages"], cmd.get("aux_index"))
            elif op == "send":
                senders[cmd["room"]].send(cmd["pages"], cmd.get("state"))
            elif op == "wait":
                s = senders[cmd["room"]]
                until = cmd.get("until")
                cond = None if until is None else (lambda st, u=until: st.value == u or st.terminal)
                out = {"state": s.wait(cmd.get("timeout", 30), cond).value, "metrics": s.metrics}
            elif op == "abort":
                senders[cmd["room"]].abort(cmd.get("reason", "test"))
            elif op == "decodes":
                out = {"decodes": [dataclasses.asdict(d) for d in agent.decodes()]}
            if "room" in cmd and cmd["room"] in senders:
                s = senders[cmd["room"]]
                e = s.failure_exception()
                out.update(state=s.state.value, error=None if e is None else f"{type(e).__name__}: {e}")
        except Exception as exc:
            out = {"raised": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)
    agent.close()
    side.close()


if __name__ == "__main__":
    main()
