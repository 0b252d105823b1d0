"""An SGLang rank's HTTP endpoint: ``pdstate serve``'s own app (``status.api.create_app``) over
one scheduler rank running backend pdstate, when ``http.port`` is configured
(``PDSTATE_HTTP__PORT``, or ``[http] port`` in the file ``PDSTATE_SGLANG_CONFIG`` names).

Ranks. Every SGLang scheduler process is one rank, numbered

    rank = dp_rank * pp_size * tp_size + pp_rank * tp_size + tp_rank

``tp_rank``: SGLang's TP rank within the pipeline stage (attention-DP and attention-TP ranks are
TP ranks: DP attention adds nothing); ``pp_rank``: the pipeline stage; ``dp_rank``: the replica
SGLang starts for ``--dp-size`` without DP attention (0 with it). The rank answers on
``http.port + rank``, bound where its agent binds: the address SGLang advertises for the rank
(``http.host`` when that is configured), under the same auth as serve (the token, when one is
configured: ``/v1/compat`` shows incarnations only to its holder; an address beyond loopback
needs one, ``settings.check_rank_auth``). Routes: ``/healthz``, ``/readyz``, ``/v1/compat``,
``/v1/compat/check`` and ``/metrics`` (``rank_status``); no transfer routes.

Where it runs. The app is served by a child process of the rank (``python -m
pdstate.status.pushed``, started when the manager is built), never in the scheduler's process:
rendering ``/metrics`` and ``/v1/compat``, HTTP parsing and uvicorn's event loop there would take
the GIL from the scheduler at every scrape. The rank binds the socket itself (a port already
taken fails the rank at start, naming it) and hands it to the child, then feeds the child
snapshots of its status (``rank_status.RankStatus.status``) over a pipe, from a daemon thread
(``status.pushed.Publisher``): only when the status changed (a request began or ended, a
handshake was answered, the agent stopped; a peer's state is looked at once a second) and at
most every 100 ms. So the scheduler's cost follows the rank's events, not the scrapes; the
documents are those of the latest snapshot (at most ~0.1 s behind an event, ~1 s behind a
peer gone). A child that does not serve within 60 s fails the rank's start, saying why; it exits
when its pipe closes (the manager closed, or the rank's process ended).
"""

from __future__ import annotations

import logging

from pdstate.errors import ConfigError

log = logging.getLogger("pdstate.integrations.sglang")

__all__ = ["RankEndpoint", "rank_number", "rank_place"]


def rank_number(tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1, dp_rank: int = 0) -> int:
    """The rank's number across TP, PP and DP (module docstring)."""
    return dp_rank * pp_size * tp_size + pp_rank * tp_size + tp_rank


def rank_place(kv_args, http_port: int, release: str | None) -> dict:
    """The running rank's ``RankModel`` fields, read from SGLang's parallel context."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()

    def read(name: str, default: int) -> int:
        try:
            value = getattr(parallel, name)
        except Exception:  # a leaf this release does not publish
            return default
        return int(value) if value is not None else default

    tp_size, pp_size = read("tp_size", 1), read("pp_size", 1)
    tp_rank = read("tp_rank", int(getattr(kv_args, "engine_rank", 0) or 0))
    pp_rank = int(getattr(kv_args, "pp_rank", 0) or 0)
    dp_attention = bool(getattr(parallel, "enable_dp_attention", False))
    dp_size = 1 if dp_attention else read("dp_size", 1)
    dp_rank = 0 if dp_attention else int(getattr(kv_args, "system_dp_rank", 0) or 0)
    rank = rank_number(tp_rank, tp_size, pp_rank, pp_size, dp_rank)
    return dict(
        rank=rank, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, dp_rank=dp_rank,
        dp_size=dp_size, sglang=release, http_port=http_port + rank,
    )  # fmt: skip


class RankEndpoint:
    """The app over ``source`` on ``host:port`` (bound here), served by a child process fed with
    ``source``'s snapshots (``status.pushed``)."""

    def __init__(self, source, host: str, port: int, token: bytes | None) -> None:
        from pdstate.status.connections import http_url, listen_socket
        from pdstate.status.pushed import Child, Publisher, facts_of

        what = f"this SGLang {source.role} rank"
        try:
            sock = listen_socket(host, port)
        except OSError as exc:
            raise ConfigError(
                f"http.port: {what} cannot listen on {host}:{port} (http.port + rank {source.rank['rank']}): {exc}"
            ) from None
        self.url = http_url(sock)
        first = source.status()
        try:
            self.child = Child(sock, facts_of(source), first, token)
        except ConfigError as exc:
            raise ConfigError(f"http.port: {what} cannot serve its endpoint on {self.url}: {exc}") from None
        finally:
            sock.close()  # the child's now
        self.source = source  # the publisher holds it weakly: a manager dropped unclosed ends the child too
        self.publisher = Publisher(self.child, source, first, name=f"pdstate-http-{port}")
        log.info("pdstate: %s rank %d answers on %s", source.role, source.rank["rank"], self.url)

    def close(self) -> None:
        """Stop serving (idempotent): the snapshots stop, the child exits (killed after 5 s)."""
        self.publisher.close()
        self.child.close()


def serve_rank(mgr, settings, kv_args, host: str) -> RankEndpoint:
    """Start the endpoint of the rank ``mgr`` manages (``settings.http_port`` is set): on
    ``settings.http_host`` or ``host`` (the rank's advertised address), port ``http_port + rank``."""
    from importlib import metadata

    from pdstate.integrations.sglang.rank_status import RankStatus

    try:
        release: str | None = metadata.version("sglang")  # the running SGLang's distribution
    except metadata.PackageNotFoundError:
        release = None
    place = rank_place(kv_args, settings.http_port, release)
    source = RankStatus(
        mgr,
        engine=settings.engine,
        transport=mgr.agent.transport(),
        verify=settings.verify,
        place=place,
    )
    port = place["http_port"] if settings.http_port else 0
    return RankEndpoint(source, settings.http_host or host, port, settings.token)
