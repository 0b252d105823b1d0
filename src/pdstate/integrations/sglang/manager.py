"""``PdStateKVManager``: one per scheduler rank, a pdstate agent over the memory SGLang's ``KVArgs`` names.

A subclass of SGLang's ``CommonKVManager`` (0.5.19's or 0.5.23's: the running SGLang's), so
everything its schedulers read of a manager is SGLang's own (``try_ensure_parallel_info``,
``prefill_info_table``, ``kv_args``, the status and failure tables, the rebootstrap executor, ...).
0.5.23's optional hooks: ``teardown`` closes the agent; deferred decode KV release, acknowledged
as soon as the agent's abort fence holds; no role switch, no host destinations (the class
attributes say so). What differs:

* prefill: a ``PrefillAgent`` bound on this rank's address (SGLang's ``local_ip``, a free port);
  its port is what the rank registers at the bootstrap server, in SGLang's format (``PUT /route``
  with ``rank_ip`` / ``rank_port``), so routers and decodes find it through SGLang's own routes;
* decode: a ``DecodeAgent``; a receiver resolves the prefill rank's ``rank_ip:rank_port`` from that
  server and its agent connects there and shakes hands (layout reports, upstream's refusals);
* what the agents cannot serve is refused at start (``launch.backend``): context parallelism,
  a decode of several PP stages, a PP prefill with a draft model, several tokenizer workers on an
  SGLang whose workers cannot know backend pdstate (0.5.19: ``settings.has_app_path_setting``).
  A PP prefill's stages feed a decode of one stage, which faces each through an agent of its
  memory sliced to the stage's layers (``stages``). Every attention-TP pairing SGLang maps is served: a prefill attention TP wider
  than the decode's (one prefill rank sends, the others complete as dummies), a decode attention
  TP wider than the prefill's (each prefill rank sends the whole request to every decode rank
  SGLang maps to it, each under a room of its own: ``replicas``); a prefill with DP attention
  serves each room from the DP rank SGLang routes it to;
* with ``http.port`` configured, the rank serves pdstate's HTTP app on ``http.port + rank``
  (``endpoint``: health, readiness, compat with every peer, metrics), off the scheduler's thread;
* SGLang's waiting and bootstrap timeouts decide (its checks and texts, in the receiver and the
  sender); the agents' own are backstops ``BACKSTOP_S`` past them.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import socket
from collections.abc import Callable

from pdstate import logs
from pdstate.agent import DecodeAgent, PrefillAgent
from pdstate.errors import AgentClosed, EngineError
from pdstate.integrations.sglang.endpoint import serve_rank
from pdstate.integrations.sglang.launch.backend import (
    context_parallel_refusal,
    pipeline_parallel_refusal,
    tokenizer_workers_refusal,
)
from pdstate.integrations.sglang.rank_status import RankCounters
from pdstate.integrations.sglang.settings import check_rank_auth, has_app_path_setting, layout_report, load_settings
from pdstate.integrations.sglang.stages import StageAgents
from pdstate.integrations.sglang.trace import TRACE_MODULE
from pdstate.protocol.report import clip

log = logging.getLogger("pdstate.integrations.sglang")

__all__ = ["build_manager", "one_prefill"]

MAX_TOPOLOGY_ERRORS = 256  # prefills whose topology SGLang refused, remembered (the oldest forgotten first)
PEER_TEXT_CHARS = 1000  # a prefill's address or SGLang's text about its answer, as logged and kept
BACKSTOP_S = 30.0  # how long past SGLang's own timeout an agent gives up on a request by itself
MAX_TRANSFER_S = 3600.0  # the longest transfer deadline the protocol carries
ONE_PREFILL_KEPT = 256  # prefill rank entries (SGLang's ``/route`` answers) whose address is kept


def peer_text(value: object) -> str:
    """Text that came from a peer or a request (a bootstrap address, SGLang's words about a
    prefill's ``/route`` answer), clipped to ``PEER_TEXT_CHARS`` and its controls escaped: what a
    log line or a request's failure reason may carry of it."""
    return logs.escape_controls(clip(str(value), PEER_TEXT_CHARS))


def remember_topology_error(errors: dict[str, str], bootstrap_addr: str, exc: BaseException) -> list[str]:
    """Keep why SGLang cannot map a prefill's ranks, as the reason every receiver aimed at it fails
    with: the text bounded (``peer_text``), at most ``MAX_TOPOLOGY_ERRORS`` prefills (a request
    names its bootstrap address). Returns the prefills forgotten to make room, the oldest first:
    the manager forgets their parallel info too, so SGLang looks them up (and this refuses them)
    again."""
    errors.pop(bootstrap_addr, None)
    forgotten = []
    while len(errors) >= MAX_TOPOLOGY_ERRORS:
        forgotten.append(next(iter(errors)))
        del errors[forgotten[-1]]
    errors[bootstrap_addr] = f"SGLang cannot map these ranks: {peer_text(exc)}"
    return forgotten


def _sglang_timeouts() -> tuple[float, float]:
    """SGLang's waiting and bootstrap timeouts (``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` /
    ``..._BOOTSTRAP_TIMEOUT``, 300 s each by default), as its own managers read them."""
    from sglang.srt.environ import envs

    return (
        float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()),
        float(envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()),
    )


def one_prefill(kept: dict, bootstrap_infos: list, address_of: Callable[[dict], str]) -> str | None:
    """The prefill agent (``address_of(info)``) behind ``bootstrap_infos`` (a receiver's prefill
    ranks, as SGLang's ``init`` resolved them) when they are one real rank, else ``None``. SGLang
    makes each request's list afresh from the same rank entries (its connection pool's dicts): the
    answer is kept in ``kept`` per entry, beside the entry itself (so its id names no other), at
    most ``ONE_PREFILL_KEPT`` entries (then ``kept`` starts over)."""
    if len(bootstrap_infos) != 1:
        return None
    info = bootstrap_infos[0]
    entry = kept.get(id(info))
    if entry is not None and entry[0] is info:
        return entry[1]
    address = None if info.get("is_dummy") else address_of(info)
    if len(kept) >= ONE_PREFILL_KEPT:
        kept.clear()
    kept[id(info)] = (info, address)
    return address


@functools.cache
def build_manager() -> type:
    """``PdStateKVManager`` (SGLang imported here, on first install)."""
    import requests
    from sglang.srt.disaggregation.common.conn import CommonKVManager, PrefillServerInfo
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils.network import NetworkAddress, get_local_ip_auto

    @functools.lru_cache(maxsize=1024)
    def _tcp_address(ip: str, port: int) -> str:
        return NetworkAddress(ip, port).to_tcp()

    class PdStateKVManager(CommonKVManager):
        """SGLang's KV manager for ``--disaggregation-transfer-backend pdstate``."""

        # SGLang 0.5.23's optional hooks: deferred decode KV release, its acknowledgement recorded
        # by the receiver the moment the agent's abort fence holds (``_send_abort_notification``),
        # and no runtime role switch.
        supports_deferred_decode_kv_release = True
        supports_role_switch = False
        supports_host_destination = False
        if hasattr(CommonKVManager, "sender_trace_module"):  # 0.5.23: SGLang traces the senders (``trace``)
            sender_trace_module = TRACE_MODULE

        def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False):
            self.role = "prefill" if disaggregation_mode == DisaggregationMode.PREFILL else "decode"
            if disaggregation_mode not in (DisaggregationMode.PREFILL, DisaggregationMode.DECODE):
                raise ValueError(f"Unsupported DisaggregationMode: {disaggregation_mode}")
            parallel = get_parallel()
            workers = int(getattr(server_args, "tokenizer_worker_num", 1) or 1)
            for refusal in (  # before anything is registered anywhere
                context_parallel_refusal(parallel.attn_cp_size, parallel.attn_dcp_size),
                # 0.5.19: SGLang waits for its schedulers (which build this manager) before it
                # spawns the tokenizer workers that would stop it less clearly
                tokenizer_workers_refusal(workers, has_app_path_setting()),
            ):
                if refusal is not None:
                    raise ValueError(refusal)
            settings = load_settings(self.role)
            logs.use_fix_words("sglang")  # this process is an SGLang rank: its refusal lines name SGLang's flags
            local_ip = get_local_ip_auto()  # what SGLang advertises for this rank (its prefill agent binds it)
            check_rank_auth(settings, self.role, local_ip)
            report = layout_report(args)
            refusal = pipeline_parallel_refusal(parallel.pp_size, self.role, draft=report.factor("draft") is not None)
            if refusal is not None:
                raise ValueError(refusal)
            common = dict(report=report, **settings.agent_options())
            # unique per process: a prefill tells its decodes apart by worker id
            rank = f"sglang-{self.role}-tp{getattr(args, 'engine_rank', 0)}-pp{getattr(args, 'pp_rank', 0)}"
            rank = f"{rank}-{socket.gethostname()[:48]}-{os.getpid()}-{secrets.token_hex(2)}"
            # SGLang's own timeouts decide (its checks, its texts, in the sender's and receiver's
            # poll); the agents' are backstops just past them, never earlier than the operator's
            waiting_s, bootstrap_s = _sglang_timeouts()
            if self.role == "prefill":
                host = NetworkAddress(local_ip, 0)
                bind = host.to_tcp()
                self.agent = PrefillAgent(
                    args, bind=bind, worker_id=rank, bootstrap_timeout_s=bootstrap_s + BACKSTOP_S, **common
                )
            else:
                decode_kw = dict(
                    transfer_timeout_s=min(MAX_TRANSFER_S, waiting_s + BACKSTOP_S),
                    dead_prefill_release_s=settings.dead_prefill_release_s,
                    **common,
                )
                self.agent = DecodeAgent(args, worker_id=rank, **decode_kw)
                self._stages = StageAgents(args, report, rank, decode_kw)
            problem = self.agent.transport()["problem"]
            if problem:  # a silent fallback (Mooncake configured for RDMA, running on TCP): never serve on it
                self.agent.close()
                raise EngineError(problem)
            self.topology_errors: dict[str, str] = {}
            self._one_prefill: dict[int, tuple[dict, str | None]] = {}  # ``one_prefill``'s answers
            self.layout_report, self.counters, self.endpoint = report, RankCounters(lambda: self.agent), None
            try:
                super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
                if settings.http_port is not None:  # the rank's HTTP endpoint (``endpoint``)
                    self.endpoint = serve_rank(self, settings, args, local_ip)
            except BaseException:
                self.close()
                raise
            self.server_socket.close(0)  # SGLang's per-rank PULL socket: this backend talks through the agent
            self._kv_replica_factor = 1  # one prefill rank sends each decode rank its copy, once

        @property
        def agent_port(self) -> int:
            return int(self.agent.address.rsplit(":", 1)[1])

        def register_to_bootstrap(self):
            """Register this prefill rank at SGLang's bootstrap server, its agent's port as ``rank_port``."""
            self.rank_port = self.agent_port
            super().register_to_bootstrap()

        def one_prefill(self, bootstrap_infos: list) -> str | None:
            """The prefill agent behind a receiver's resolved prefill ranks when they are one real
            rank (the usual case), else ``None`` (``one_prefill``: asked by every receiver's
            ``init`` on the scheduler thread, made once per prefill rank entry)."""
            return one_prefill(self._one_prefill, bootstrap_infos, self.agent_address)

        def agent_address(self, bootstrap_info: dict) -> str:
            """The prefill agent behind one ``/route`` answer (``rank_ip``, ``rank_port``); asked by
            every receiver's ``init`` on the scheduler thread: each address is made once."""
            return _tcp_address(bootstrap_info["rank_ip"], int(bootstrap_info["rank_port"]))

        def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
            """SGLang's own lookup; a topology SGLang's rank mapping refuses is kept as the reason
            every receiver aimed at that prefill fails with (raising here would stop the decode
            scheduler).

            SGLang's page-size and KV-dtype checks raise here, and the prefill would then wait for its
            requests until its bootstrap timeout: those pairs go on to the agents' handshake instead,
            which refuses them on both sides with the factor named."""
            try:
                return super().try_ensure_parallel_info(bootstrap_addr)
            except (RuntimeError, AssertionError) as exc:  # SGLang's checks and its rank-mapping asserts
                log.error("pdstate: prefill %s: %s", peer_text(bootstrap_addr), peer_text(exc))
            info = self._info_unchecked(bootstrap_addr)
            if info is None:
                return False
            try:
                self._resolve_rank_mapping(info)
            except AssertionError as exc:  # a topology SGLang's mapping refuses: every request fails with it
                for forgotten in remember_topology_error(self.topology_errors, bootstrap_addr, exc):
                    self.prefill_info_table.pop(forgotten, None)
            self.prefill_info_table[bootstrap_addr] = info
            return True

        def _info_unchecked(self, bootstrap_addr: str):
            """SGLang's ``/route`` answer, without its page-size and dtype checks (``None``: not yet)."""
            url = f"http://{bootstrap_addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
            try:
                response = requests.get(url, timeout=5)
                if response.status_code != 200:
                    return None
                return PrefillServerInfo(**response.json())
            except Exception as exc:  # as SGLang's own lookup: logged, retried by the scheduler
                log.error(
                    "pdstate: prefill %s: cannot read its parallel info: %s", peer_text(bootstrap_addr), peer_text(exc)
                )
                return None

        def agent_failure(self):
            """Why this rank's agent can no longer serve a request (its one I/O thread has ended
            while the agent is open), else ``None``: every live request then fails with it."""
            if self.agent.closed or self.agent.alive:
                return None
            return AgentClosed(
                f"the pdstate {self.role} agent's I/O thread has ended unexpectedly (see the log); "
                "this rank cannot transfer any more: restart it"
            )

        def register_buffer_to_engine(self):
            """The agent registered the buffers when it was built (SGLang calls this after resuming)."""

        def deregister_buffer_to_engine(self):
            """Kept registered: the agent owns the registration for its whole life."""

        def agent_for(self, pp_rank: int, pp_size: int):
            """The decode agent facing prefill stage ``pp_rank`` of ``pp_size`` (``stages``): this
            rank's own agent for a prefill of one stage."""
            return self.agent if pp_size <= 1 else self._stages.agent(pp_rank, pp_size)

        def close(self) -> None:
            if self.endpoint is not None:
                self.endpoint.close()
            self.agent.close()
            stages = getattr(self, "_stages", None)
            if stages is not None:
                stages.close()
            # SGLang's own context (its PULL socket, cached PUSH sockets): destroyed here, while its
            # sockets are reachable, never by the garbage collector, whose ``term()`` can block
            # for good on a socket freed in the same cycle (seen: the next manager's start hung)
            ctx = getattr(self, "_zmq_ctx", None)
            if ctx is not None and not ctx.closed:
                ctx.destroy(linger=0)

        def teardown(self) -> None:
            """SGLang 0.5.23's release of a manager's transfer resources: the agent closes."""
            self.close()

    PdStateKVManager.__qualname__ = "PdStateKVManager"
    return PdStateKVManager
