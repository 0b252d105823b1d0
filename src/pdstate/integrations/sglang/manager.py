"""``PdStateKVManager``: one per scheduler rank, a pdstate agent over the memory SGLang's ``KVArgs`` names.

A subclass of SGLang's ``CommonKVManager``, so everything its schedulers read of a manager is
SGLang's own (``try_ensure_parallel_info``, ``prefill_info_table``, ``kv_args``, the status and
failure tables, the rebootstrap executor, ...). What differs:

* prefill: a ``PrefillAgent`` bound on this rank's address (SGLang's ``local_ip``, a free port);
  its port is what the rank registers at the bootstrap server, in SGLang's format (``PUT /route``
  with ``rank_ip`` / ``rank_port``), so routers and decodes find it through SGLang's own routes;
* decode: a ``DecodeAgent``; a receiver resolves the prefill rank's ``rank_ip:rank_port`` from that
  server and its agent connects there and shakes hands (layout reports, upstream's refusals);
* the topologies the agents cannot serve are refused per prefill, with the reason, on every
  request aimed at it: pipeline-parallel sizes that differ, and a decode attention-TP wider than
  the prefill's (one prefill rank would feed several decode ranks the same room).
  A prefill attention-TP wider than the decode's works as SGLang maps it for MLA-like KV: one
  prefill rank sends, the others complete as dummies.
"""

from __future__ import annotations

import functools
import logging

from pdstate.agent import DecodeAgent, PrefillAgent
from pdstate.integrations.sglang.settings import layout_report, load_settings

log = logging.getLogger("pdstate.integrations.sglang")

__all__ = ["build_manager"]


@functools.cache
def build_manager() -> type:
    """``PdStateKVManager`` (SGLang imported here, on first install)."""
    import requests
    from sglang.srt.disaggregation.common.conn import CommonKVManager, PrefillServerInfo
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.utils.network import NetworkAddress, get_local_ip_auto

    class PdStateKVManager(CommonKVManager):
        """SGLang's KV manager for ``--disaggregation-transfer-backend pdstate``."""

        def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False):
            self.role = "prefill" if disaggregation_mode == DisaggregationMode.PREFILL else "decode"
            if disaggregation_mode not in (DisaggregationMode.PREFILL, DisaggregationMode.DECODE):
                raise ValueError(f"Unsupported DisaggregationMode: {disaggregation_mode}")
            settings = load_settings(self.role)
            report = layout_report(args)
            common = dict(
                report=report,
                engine=settings.engine,
                engine_options=settings.engine_options,
                token=settings.token,
                heartbeat_interval_s=settings.heartbeat_interval_s,
                peer_timeout_s=settings.peer_timeout_s,
            )
            rank = f"{self.role}-tp{getattr(args, 'engine_rank', 0)}-pp{getattr(args, 'pp_rank', 0)}"
            if self.role == "prefill":
                host = NetworkAddress(get_local_ip_auto(), 0)
                bind = host.to_tcp()
                self.agent = PrefillAgent(args, bind=bind, worker_id=rank, **common)
            else:
                self.agent = DecodeAgent(args, worker_id=rank, **common)
            self.topology_errors: dict[str, str] = {}
            try:
                super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
            except BaseException:
                self.agent.close()
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

        def agent_address(self, bootstrap_info: dict) -> str:
            """The prefill agent behind one ``/route`` answer (``rank_ip``, ``rank_port``)."""
            return NetworkAddress(bootstrap_info["rank_ip"], int(bootstrap_info["rank_port"])).to_tcp()

        def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
            """SGLang's own lookup; a topology this backend cannot serve is kept as the reason every
            receiver aimed at that prefill fails with (raising here would stop the decode scheduler).

            SGLang's page-size and KV-dtype checks raise here, and the prefill would then wait for its
            requests until its bootstrap timeout: those pairs go on to the agents' handshake instead,
            which refuses them on both sides with the factor named."""
            try:
                if not super().try_ensure_parallel_info(bootstrap_addr):
                    return False
            except RuntimeError as exc:
                log.error("pdstate: prefill %s: %s (the handshake refuses the pair on both sides)", bootstrap_addr, exc)
                if not self._info_unchecked(bootstrap_addr):
                    return False
            info = self.prefill_info_table[bootstrap_addr]
            reason = None
            if info.pp_size != self.pp_size:
                reason = (
                    f"pipeline-parallel sizes differ: prefill pp_size={info.pp_size}, decode pp_size={self.pp_size}; "
                    "pdstate's SGLang backend moves a whole layer stack per rank (use the same --pp-size)"
                )
            elif self.attn_tp_size > info.attn_tp_size:
                reason = (
                    f"decode attention TP size {self.attn_tp_size} is larger than the prefill's "
                    f"{info.attn_tp_size}: pdstate's SGLang backend feeds each decode rank from one prefill rank "
                    "that sends to it alone (use a decode attention TP no larger than the prefill's)"
                )
            if reason is not None:
                self.topology_errors[bootstrap_addr] = reason
                log.error("pdstate: prefill %s: %s", bootstrap_addr, reason)
            return True

        def _info_unchecked(self, bootstrap_addr: str) -> bool:
            """SGLang's ``/route`` lookup and rank mapping, without its page-size and dtype checks."""
            url = f"http://{bootstrap_addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
            try:
                response = requests.get(url, timeout=5)
                if response.status_code != 200:
                    return False
                info = PrefillServerInfo(**response.json())
            except Exception as exc:  # as SGLang's own lookup: logged, retried by the scheduler
                log.error("pdstate: prefill %s: cannot read its parallel info: %s", bootstrap_addr, exc)
                return False
            self._resolve_rank_mapping(info)
            self.prefill_info_table[bootstrap_addr] = info
            return True

        def register_buffer_to_engine(self):
            """The agent registered the buffers when it was built (SGLang calls this after resuming)."""

        def deregister_buffer_to_engine(self):
            """Kept registered: the agent owns the registration for its whole life."""

        def close(self) -> None:
            self.agent.close()

    PdStateKVManager.__qualname__ = "PdStateKVManager"
    return PdStateKVManager
