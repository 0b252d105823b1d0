"""Prometheus metrics of one worker, collected from its status source at scrape time."""

from __future__ import annotations

import bisect
import itertools

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pdstate.protocol.wire import PROTOCOL_VERSION
from pdstate.status.models import PeerModel, StatusSource
from pdstate.worker.migrate import DOWNTIME_BUCKETS_S as MIGRATION_BUCKETS_S

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Collector:
    """Reads the worker's counters at scrape time. The latency histogram is folded in
    incrementally: each scrape only bins what was appended since the last one. The worker keeps
    a bounded window (``worker.stats.RecentLatencies``: ``since(seen)`` and ``total``); a plain
    list (tests' fakes) is read by position."""

    def __init__(self, source: StatusSource) -> None:
        self.source = source
        self._seen = 0
        self._bins = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self._sum = 0.0
        self._count = 0

    def collect(self):
        src = self.source
        stats = src.stats
        lat = stats.latencies_s
        if hasattr(lat, "since"):
            # values beyond the window (more than its size between two scrapes) are not binned
            new, self._seen = lat.since(self._seen)
        else:
            n = len(lat)
            if n < self._seen:  # the list was trimmed: count what is there from now on
                self._seen = n
            new, self._seen = list(itertools.islice(lat, self._seen, n)), n
        for v in new:
            self._bins[bisect.bisect_left(LATENCY_BUCKETS_S, v)] += 1
            self._sum += v
            self._count += 1

        info = GaugeMetricFamily(
            "pdstate_worker_info",
            "Worker identity (value 1)",
            labels=["role", "worker_id", "engine", "protocol_version", "fingerprint"],
        )
        info.add_metric([src.role, src.worker_id, src.engine, str(PROTOCOL_VERSION), src.report.fingerprint], 1)
        yield info
        ready = GaugeMetricFamily("pdstate_ready", "1 when /readyz answers 200")
        ready.add_metric([], 1 if src.readiness().ready else 0)
        yield ready
        hs = CounterMetricFamily("pdstate_handshakes", "Handshakes by outcome", labels=["outcome"])
        for k, v in stats.handshakes.items():
            hs.add_metric([k], v)
        yield hs
        tr = CounterMetricFamily(
            "pdstate_transfers",
            "Transfers by outcome (busy: refused by a full prefill and retried)",
            labels=["outcome"],
        )
        for k, v in stats.transfers.items():
            tr.add_metric([k], v)
        yield tr
        yield CounterMetricFamily("pdstate_transfer_bytes", "Bytes moved by successful transfers", value=stats.bytes)
        cum, buckets = 0, []
        for bound, count in zip(LATENCY_BUCKETS_S, self._bins):
            cum += count
            buckets.append((repr(bound), cum))
        buckets.append(("+Inf", self._count))
        h = HistogramMetricFamily(
            "pdstate_transfer_latency_seconds",
            "Latency of successful transfers (decode: submit to verified; prefill: engine copy)",
        )
        h.add_metric([], buckets, sum_value=self._sum)
        yield h
        g = GaugeMetricFamily("pdstate_transfers_in_flight", "Requests entered and not yet finished")
        g.add_metric([], src.in_flight())
        yield g
        q = GaugeMetricFamily(
            "pdstate_quarantined_requests",
            "Decode: ended requests whose pages wait for their prefill's fence (it may still write them)",
        )
        q.add_metric([], getattr(src, "quarantined", lambda: 0)())
        yield q
        qp = GaugeMetricFamily(
            "pdstate_quarantined_pages",
            "Decode: the main-KV pages of those requests, out of the free pool until their prefill's fence",
        )
        qp.add_metric([], getattr(src, "quarantined_pages", lambda: 0)())
        yield qp
        failures = CounterMetricFamily(
            "pdstate_transfer_failures",
            "Failed transfers by kind (the error's class) and factor (the layout factor a refusal names, "
            "else the class)",
            labels=["kind", "factor"],
        )
        for (kind, factor), n in getattr(stats, "failures", {}).items():
            failures.add_metric([kind, factor], n)
        yield failures
        verified = CounterMetricFamily(
            "pdstate_transfers_verified", "Successful transfers by the verification level that ran", labels=["level"]
        )
        for level, n in getattr(stats, "verified", {}).items():
            verified.add_metric([level], n)
        yield verified
        level = getattr(src, "verify", None)
        if level is not None:
            lv = GaugeMetricFamily(
                "pdstate_verify_level", "The verification level configured (value 1)", labels=["level"]
            )
            lv.add_metric([str(level)], 1)
            yield lv
        yield CounterMetricFamily("pdstate_engine_errors", "Transfer engine failures", value=stats.engine_errors)
        yield CounterMetricFamily(
            "pdstate_protocol_errors",
            "Control frames refused (undecodable, bad auth, bad version)",
            value=stats.protocol_errors,
        )
        yield CounterMetricFamily(
            "pdstate_auth_failures",
            "Refused CURVE handshakes and control frames refused for their auth tag (a token on one side only, or two tokens)",
            value=stats.auth_failures,
        )
        yield CounterMetricFamily(
            "pdstate_decodes_dropped",
            "Decodes a prefill dropped for withholding their verdicts (control.verdict_timeout_s)",
            value=stats.decodes_dropped,
        )
        yield CounterMetricFamily(
            "pdstate_waiting_refused",
            "Decodes' requests a prefill refused because agent.refusals.MAX_WAITING_REQUESTS already waited for their senders",
            value=stats.waiting_refused,
        )
        peers = GaugeMetricFamily("pdstate_peers", "Peers by handshake state", labels=["state"])
        counts = {k: 0 for k in ("accepted", "rejected", "pending", "gone")}
        for p in src.peers():  # the status source's documents, read as the API's model
            state = PeerModel.model_validate(p).state
            counts[state] = counts.get(state, 0) + 1
        for k, v in counts.items():
            peers.add_metric([k], v)
        yield peers
        yield from _migrations(src)
        free = GaugeMetricFamily("pdstate_pool_free", "Free capacity of the pools", labels=["pool"])
        for k, v in src.free_counts().items():
            free.add_metric([k], v)
        yield free


def _migrations(src):
    """Decode: migrations by outcome, their downtime (paused -> running on the target) and the
    bytes they moved (``worker.migrate.MigrationStats``; zeros before the first)."""
    read = getattr(src, "migration_stats", None)
    if read is None:
        return
    s = read()
    outcomes = {"success": 0, "failed": 0, "refused": 0} if s is None else s.outcomes
    c = CounterMetricFamily(
        "pdstate_migrations", "Decode: running requests migrated to another decode, by outcome", labels=["outcome"]
    )
    for k, v in outcomes.items():
        c.add_metric([k], v)
    yield c
    yield CounterMetricFamily(
        "pdstate_migration_bytes", "Decode: bytes moved by successful migrations", value=0 if s is None else s.bytes
    )
    bins = [0] * (len(MIGRATION_BUCKETS_S) + 1) if s is None else s.bins
    cum, buckets = 0, []
    for bound, count in zip(MIGRATION_BUCKETS_S, bins):
        cum += count
        buckets.append((repr(bound), cum))
    buckets.append(("+Inf", sum(bins)))
    h = HistogramMetricFamily(
        "pdstate_migration_downtime_seconds",
        "Decode: a migrated request's downtime, paused here -> running on the target (successful migrations)",
    )
    h.add_metric([], buckets, sum_value=0.0 if s is None else s.downtime_sum)
    yield h
