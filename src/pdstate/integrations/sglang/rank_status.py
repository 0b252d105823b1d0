"""What an SGLang rank's HTTP endpoint reads (``status.api``'s status source over one manager),
and what the rank counts for it.

``RankCounters``: the rank's transfers, bytes, latencies, failures by kind and factor and the
verification level that ran. A request is counted when it ends, by a done callback on its agent
sender or receiver (``watch``): that runs on the agent's I/O thread, never on the scheduler's,
and only adds to counters under a lock. A request that failed before it had an agent request (a
decode the prefill refused, a topology SGLang cannot map) is counted where SGLang's side fails it
(``failed``). One ``request_end`` log line per request (``pdstate.logs``, INFO).

``RankStatus``: ``api.StatusSource`` over the manager: every read is a snapshot (the agent's
peers, taken on its I/O thread in one call; the counters' copy); none touches SGLang's scheduler.
It serves no synthetic transfers (``serves_transfers``): the rank's transfers are SGLang's
requests. The endpoint's process reads it as snapshots (``status``, ``status.pushed``), taken
when ``changed`` is set (a request began or ended) or ``status_key`` moved (a handshake answered,
an auth failure, the agent closed or its thread ended), and once a second besides.
"""

from __future__ import annotations

import logging
import threading

from pdstate import logs
from pdstate.errors import AgentClosed
from pdstate.protocol.lifecycle import PeerState, RequestState
from pdstate.protocol.peers import PeerSnapshot, PrefillSnapshot
from pdstate.protocol.report import ErrorInfo
from pdstate.worker.stats import Stats

log = logging.getLogger("pdstate.integrations.sglang")

__all__ = ["RankCounters", "RankStatus"]


class _AgentCounts(Stats):
    """``worker.stats.Stats`` with the agent's own handshake and auth-failure counts, read at snapshot."""

    def __init__(self, agent) -> None:
        super().__init__()
        self._agent = agent

    def snapshot(self) -> Stats:
        s = super().snapshot()
        agent = self._agent()
        s.handshakes = dict(agent.handshakes)
        s.auth_failures = agent.auth_failures.count
        s.decodes_dropped = agent.withheld.count if hasattr(agent, "withheld") else 0  # (a prefill agent)
        s.waiting_refused = agent.waiting_refused if hasattr(agent, "waiting_refused") else 0
        return s


class RankCounters:
    """The rank's counters (``worker.stats.Stats``, the agent's handshake counts read at snapshot)."""

    def __init__(self, agent) -> None:
        self.stats = _AgentCounts(agent)
        self._lock = threading.Lock()
        self.begun = 0
        self.ended = 0
        self.changed = threading.Event()  # set at every count: the endpoint's snapshots wait on it

    def in_flight(self) -> int:
        with self._lock:
            return self.begun - self.ended

    def watch(self, handle, peer: str) -> None:
        """Count the agent request ``handle`` (a ``KVSender`` or ``KVReceiver``) when it ends."""
        with self._lock:
            self.begun += 1
        # on SGLang's scheduler thread, per request: set only when clear (a set Event's ``set`` takes
        # its condition's lock); the count above precedes the look, so a snapshot after a clear sees it
        if not self.changed.is_set():
            self.changed.set()
        handle.add_done_callback(lambda h: self._ended(h, peer))

    def _ended(self, handle, peer: str) -> None:
        with self._lock:
            self.ended += 1
        m = handle.metrics
        nbytes = int(m.get("bytes", 0))
        seconds = float(m.get("transfer_s") or 0.0)
        level = str(m.get("verify", "off"))
        if handle.poll() is RequestState.SUCCESS:
            self.stats.success(nbytes, seconds, level)
            self.changed.set()
            outcome = "ok"
        else:
            error = handle.failure_exception()
            self.failed(error)
            outcome = f"failed: {type(error).__name__ if error is not None else 'TransferFailed'}"
        logs.request_end(
            log, room=handle.room, peer=peer, nbytes=nbytes, ms=seconds * 1e3, outcome=outcome, verification=level
        )

    def failed(self, error: BaseException | None) -> None:
        """One failed request (``watch``'s, or one that never had an agent request)."""
        kind = type(error).__name__ if error is not None else "TransferFailed"
        message = str(error) if error is not None else "failed"
        self.stats.fail(f"{kind}: {message}", kind, logs.refusal_factor(kind, message))
        self.changed.set()


class RankStatus:
    """``api.StatusSource`` over a ``PdStateKVManager`` (``mgr``: its ``role``, ``agent``,
    ``agent_failure()`` and ``counters``); ``place``: the rank's ``RankModel`` fields."""

    serves_transfers = False

    def __init__(self, mgr, *, engine: str, transport: dict, verify: str, place: dict) -> None:
        self._mgr = mgr
        agent = mgr.agent
        self.role: str = mgr.role
        self.worker_id: str = agent.worker_id
        self.incarnation: str = agent.incarnation
        self.engine = engine
        self.transport = transport  # the agent engine's (``AgentLifetime.transport``), fixed at start
        from pdstate.status.models import peer_transport  # only where the endpoint runs

        self._peer_transport = peer_transport(transport)
        self.verify = verify
        self.rank = place
        self.control: str = agent.address if mgr.role == "prefill" else ""
        self.report = mgr.layout_report
        self.changed = mgr.counters.changed
        self._seen = 0  # the latencies the snapshots carried so far

    @property
    def stats(self):
        return self._mgr.counters.stats.snapshot()

    def local_check(self):
        r = self.report.local_check
        return r.ok, r.error

    def _snapshot(self) -> list[PeerSnapshot | PrefillSnapshot] | None:
        """The agent's peers: a prefill's decodes, a decode's prefills (``None``: the agent is closed)."""
        agent = self._mgr.agent
        try:
            return agent.peers() if self.role == "prefill" else list(agent.prefills().values())
        except (AgentClosed, TimeoutError):
            return None

    def _docs(self, peers: list[PeerSnapshot | PrefillSnapshot] | None) -> list[dict]:
        """``peers`` in ``/v1/compat``'s form: ``PeerModel``'s fields, in its order."""
        return [
            {
                "id": p.id if isinstance(p, PeerSnapshot) else p.address,
                "state": p.state.value,
                "error": None if p.error is None else p.error.model_dump(),
                "incarnation": p.incarnation,
                "fingerprint": p.fingerprint,
                "transport": self._peer_transport if p.state is PeerState.ACCEPTED else None,
            }
            for p in peers or ()
        ]

    def peers(self) -> list[dict]:
        return self._docs(self._snapshot())

    def status(self) -> dict:
        """One snapshot for the endpoint's process (``status.pushed.status_of``): one call on
        the agent's I/O thread, the counters' copy, the latencies added since the previous one."""
        from pdstate.status.pushed import status_of

        peers = self._snapshot()
        stats = self.stats
        new, self._seen = stats.latencies_s.since(self._seen)
        return status_of(self.readiness(peers), self._docs(peers), stats, self.in_flight(), (new, self._seen))

    def status_key(self) -> tuple:
        """What moves, without a call on the agent's thread, when a peer's handshake is answered
        or the agent stops: compared by the endpoint's snapshots, a few times a second."""
        agent = self._mgr.agent
        return (tuple(agent.handshakes.values()), agent.auth_failures.count, agent.closed, agent.alive)

    def readiness(self, peers: list[PeerSnapshot | PrefillSnapshot] | None | bool = False):
        """Ready: the agent alive (and its pair's local check passed) and, on a decode, at least
        one prefill accepted this rank; else why not. ``peers``: the agent's, already taken
        (``None``: the agent was closed); by default taken here."""
        from pdstate.status.models import Readiness  # only where the endpoint runs (``endpoint``)

        mgr = self._mgr
        if mgr.agent.closed:
            return Readiness(False, "the pdstate agent of this rank is closed", "shutdown")
        dead = mgr.agent_failure()
        if dead is not None:
            return Readiness(False, str(dead), "threads")
        ok, err = self.local_check()
        if not ok:
            return Readiness(False, err.message, "local_check", err)
        if peers is False:
            peers = self._snapshot()
        if peers is None:
            return Readiness(False, "the pdstate agent of this rank is closed", "shutdown")
        if self.role == "prefill" or any(p.state is PeerState.ACCEPTED for p in peers):
            return Readiness(True)
        for p in peers:  # a decode's prefills (``PrefillSnapshot``)
            if p.state is PeerState.REJECTED:
                e = p.error or ErrorInfo(type="RuntimeError", message="handshake refused")
                return Readiness(False, f"refused by the prefill at {p.address}: {e.message}", "handshake", e)
        for p in peers:
            if p.state is PeerState.GONE:
                why = p.error.message if p.error else "no heartbeat"
                return Readiness(False, f"the prefill at {p.address} is gone ({why})", "peer")
        if peers:
            return Readiness(False, f"waiting for the prefill at {peers[0].address} to answer the handshake", "peer")
        return Readiness(False, "no prefill accepted yet: a decode rank dials the prefill of its first request", "peer")

    def in_flight(self) -> int:
        return self._mgr.counters.in_flight()

    def free_counts(self) -> dict[str, int]:
        return {}  # SGLang's allocators own the pages

    def result_timeout_s(self) -> float:
        return 0.0
