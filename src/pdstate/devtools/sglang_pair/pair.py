"""The parent of the two-process SGLang driver: a prefill child and a decode child, driven in SGLang's order.

``Pair`` starts both children (``side.py``) under the cached SGLang environment and keeps them for
as many cases as asked (each case gets its own bootstrap server port and managers; a child reuses
the pools of a side it has built). ``run_case`` runs requests one after another in SGLang's call
order: the prefill's sender is created and ``init``-ed; the decode fetches the prefill's parallel
info, creates its receiver, ``init``s it and sends its metadata (pages and per-``StateType`` state
indices); then, at once on both sides, the prefill sends two chunks (state on the last; one for a
one-page request) and polls
while the decode polls; every decode byte is checked. Nothing waits past ``deadline_s`` per side.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from pdstate.devtools.sglang_pair.cases import Case
from pdstate.devtools.sglang_pair.child import ChildPair
from pdstate.integrations.sglang import releases

REPLY = "@@pair "
SIDE_MODULE = "pdstate.devtools.sglang_pair.side"  # what each child runs
REPO_SRC = Path(__file__).resolve().parents[3]
# SGLang's Mooncake backend over TCP on one host (no RDMA here).
MOONCAKE_TCP = {
    "MOONCAKE_PROTOCOL": "tcp",
    "MC_FORCE_TCP": "1",
    "SGLANG_HOST_IP": "127.0.0.1",
    "PDSTATE_TRANSFER__MOONCAKE__ALLOW_OPEN_LISTENER": "true",  # one host, the tests' own processes
}
# Backend "pdstate" moves the bytes with pdstate's Mooncake engine (its usual configuration).
PDSTATE_ENGINE_ENV = {"PDSTATE_TRANSFER__ENGINE": "mooncake"}
SLACK_S = 30.0  # what a child may take beyond a request's deadline to answer (setup, byte checks)


def env_release(target: Path) -> str | None:
    """The SGLang version installed in the environment ``target`` (its ``sglang-*.dist-info``)."""
    found = sorted(Path(target).glob("sglang-*.dist-info"))
    return found[-1].name[len("sglang-") : -len(".dist-info")] if found else None


def env_dir(release: str | None = None) -> Path:
    """The cached environment of ``release`` (its row's ``env_dir`` under the venv: ``sglang-env``
    for the lock's own line, else ``sglang-env-<release>``; default the lock's release);
    ``$PDSTATE_SGLANG_ENV`` replaces the one of the release it holds (with no release asked:
    whichever it holds)."""
    default = releases.in_lock().version
    override = os.environ.get("PDSTATE_SGLANG_ENV")
    if override:
        held = env_release(Path(override))
        if release is None or held == release or (held is None and release == default):
            return Path(override)
    release = release or default
    if releases.find(release) is None:
        raise ValueError(f"unknown SGLang release {release!r} (known: {', '.join(releases.versions())})")
    return Path(sys.prefix) / releases.row(release).env_dir


def child_env(target: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    env.update(MOONCAKE_TCP)
    env.update(extra or {})
    env["PDSTATE_SGLANG_ENV"] = str(target)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_SRC)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["PYTHONWARNINGS"] = "ignore"
    env["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    return env


def mooncake_missing() -> str | None:
    """One line when Mooncake's Python package (``mooncake.engine``, which both SGLang's backend and
    pdstate's Mooncake engine use) cannot be imported here, else ``None``."""
    from pdstate.errors import EngineUnavailable
    from pdstate.transfer.engines.mooncake import MooncakeEngine

    try:
        MooncakeEngine.check_available()
    except EngineUnavailable as exc:
        return f"the SGLang pair needs Mooncake: {exc}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pair(ChildPair):
    """A prefill child and a decode child; ``extra_env`` for both (e.g. ``PDSTATE_TRANSFER__ENGINE``)."""

    MODULE = SIDE_MODULE  # what the children run (a subclass's children: ``side``'s commands and more)

    def __init__(self, target: Path | None = None, extra_env: dict[str, str] | None = None) -> None:
        super().__init__(child_env(target or env_dir(), extra_env), self.MODULE, REPLY)
        self.room = 1000

    def setup(self, case: Case, backend: str) -> tuple[dict, dict]:
        port = free_port()
        p = self.prefill.call(
            "setup", SLACK_S * 4, role="prefill", backend=backend, side=case.prefill.to_json(), port=port
        )
        if not p["ok"]:
            return p, {"ok": False, "error": "not set up (the prefill's setup failed)"}
        d = self.decode.call(
            "setup", SLACK_S * 4, role="decode", backend=backend, side=case.decode.to_json(), port=port
        )
        return p, d

    def use(self, backend: str) -> None:
        """Switch both children back to their last ``setup`` of ``backend`` (same pools, same managers)."""
        for child in (self.prefill, self.decode):
            reply = child.call("use", SLACK_S, backend=backend)
            if not reply["ok"]:
                raise RuntimeError(f"the {child.role} child has no {backend} session: {reply['error']}")

    def request(self, tokens: int, deadline_s: float, early_send: bool = False) -> dict:
        """One request in SGLang's order; ``early_send``: the prefill is told to send before the
        decode sends its metadata (it polls until the metadata arrives, then sends at once, as a
        prefill whose forward is done would), so that the decode's metadata -> Success
        (``metadata_to_success_ms``) holds no wait on this parent."""
        self.room += 1
        room = self.room
        t0 = time.perf_counter()
        opened = self.prefill.call("open", SLACK_S, room=room, tokens=tokens)
        if not opened["ok"]:
            return {"tokens": tokens, "prefill": {"outcome": "error", "failure": opened["error"]}, "decode": {}}
        if early_send:
            self.prefill.tell("send", deadline_s=deadline_s)
        recv = self.decode.call("recv", deadline_s + SLACK_S, room=room, tokens=tokens, deadline_s=deadline_s)
        if not recv["ok"]:
            recv = {"outcome": "error", "failure": recv["error"]}
        if not early_send:
            self.prefill.tell("send", deadline_s=deadline_s)
        if recv["outcome"] == "sent":
            dec = self.decode.call("wait", deadline_s + SLACK_S, deadline_s=deadline_s)
            if not dec["ok"]:
                dec = {"outcome": "error", "failure": dec["error"]}
        else:
            dec = recv
        pre = self.prefill.answer(deadline_s + SLACK_S)
        if not pre["ok"]:
            pre = {"outcome": "error", "failure": pre["error"]}
        for side in (pre, dec):
            side.pop("ok", None)
            side.pop("trace", None)
        ms = pre.pop("ms", None)
        return {
            "tokens": tokens,
            "prefill": pre,
            "decode": dec,
            "send_to_success_ms": ms,
            "metadata_to_success_ms": dec.pop("ms", None),
            "elapsed_s": time.perf_counter() - t0,
        }

    def run_case(
        self, case: Case, backend: str, tokens: tuple[int, ...] | None = None, deadline_s: float = 3.0
    ) -> dict:
        """One case: set up both sides (managers of ``backend``), then each request of ``tokens``
        (the case's own lengths unless told)."""
        p, d = self.setup(case, backend)
        out = {"case": case.name, "what": case.what, "backend": backend, "deadline_s": deadline_s}
        out["sglang"] = p.get("sglang") or d.get("sglang")  # the release the children imported
        if not (p["ok"] and d["ok"]):
            out["setup_error"] = p.get("error") or d.get("error")
            out["requests"] = []
            return out
        out["requests"] = [self.request(n, deadline_s) for n in (tokens or case.tokens)]
        return out
