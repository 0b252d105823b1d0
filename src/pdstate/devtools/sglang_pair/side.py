"""One side (prefill or decode) of the two-process SGLang driver: ``python -m pdstate.devtools.sglang_pair.side``.

Run only by ``pair.Pair`` under the cached SGLang environment: importing ``booted`` changes
process-wide state. Reads one JSON command per line on stdin and answers each with one line
``@@pair {json}`` on stdout (anything else on stdout is SGLang's and ignored). Commands:

Both releases: the child follows the SGLang it imported (``boot.release()``), which ``setup``
reports; 0.5.23's prefill makes its sender with keywords only.

- ``setup``: publish the side's server args, build (or reuse) its pools, fill ``KVArgs``, and
  create the manager of ``backend`` through ``get_kv_class`` (the prefill starts the bootstrap
  server first, through ``get_kv_class(backend, BOOTSTRAP_SERVER)``); ``use`` makes an earlier
  setup of a backend current again (the bench interleaves backends on the same pools);
  ``pdstate@LEVEL`` is backend ``pdstate`` with ``PDSTATE_TRANSFER__VERIFY=LEVEL`` when its manager
  is made (a session of its own beside plain ``pdstate``, which takes the configured default);
- prefill ``open`` (sender created and ``init``-ed, sources patterned) then ``send`` (two chunks,
  state on the last; a one-page request in one, with its state; polled to Success/Failed or the
  deadline);
- ``trace_on`` / ``spans`` / ``trace_off``: SGLang's request tracing on, its spans recorded in the
  child (``tracing``), and off again;
- decode ``recv`` (destinations reset to the sentinel, parallel info fetched, receiver ``init``,
  ``send_metadata``) then ``wait`` (polled, then every registered byte checked).
"""

from __future__ import annotations

from pdstate.devtools.sglang_pair import booted  # noqa: F401  (first: the GPU-only stubs and the bare sglang package)

# isort: split

import os
import time
from types import SimpleNamespace

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

from pdstate.devtools.sglang_pair import boot, moved, pattern, pools, tracing
from pdstate.devtools.sglang_pair.cases import Side
from pdstate.devtools.sglang_pair.child import error_text, serve

REPLY = "@@pair "
HOST = "127.0.0.1"
POLL_S = 0.0002
STATES = {KVPoll.Failed: "Failed", KVPoll.Bootstrapping: "Bootstrapping", KVPoll.WaitingForInput: "WaitingForInput",
          KVPoll.Transferring: "Transferring", KVPoll.Success: "Success"}  # fmt: skip
PREFILL_SLOT, DECODE_SLOT = 0, 2  # request slots (and aux rows): different on the two sides on purpose


def _parallel_context() -> None:
    """tp = cp = dp = pp = 1 without torch.distributed (what the managers read; once per process)."""
    if not S.parallel:
        boot.parallel_context()
        S.parallel = True


def _mooncake_engine() -> None:
    from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as mte

    mte.init_mooncake_transfer_engine(hostname=HOST, gpu_id=0)


# This child's state: pools by side (reused across cases), bootstrap servers by port, the current
# case's pools, KVArgs and manager, and the request in flight with its sender or receiver.
S = SimpleNamespace(role="", backend="", addr="", pools={}, servers={}, cur=None, args=None, mgr=None, req=None,
    conn=None, installed=False, parallel=False, sessions={})  # fmt: skip
SESSION = ("backend", "addr", "cur", "args", "mgr")  # what ``use`` brings back


# -- both sides
def setup(role: str, backend: str, side: dict, port: int) -> dict:
    session = backend
    backend, _, verify = backend.partition("@")
    if verify:
        os.environ["PDSTATE_TRANSFER__VERIFY"] = verify
    S.role, S.backend, S.addr = role, backend, f"{HOST}:{port}"
    S.mgr = S.conn = S.req = None
    if backend == "pdstate" and not S.installed:
        import pdstate.integrations.sglang as integration

        integration.install()
        S.installed = True
    s = Side.from_json(side)
    boot.publish(
        boot.server_args(
            speculative=s.speculative, page_size=s.page_size, disaggregation_mode=role,
            disaggregation_transfer_backend=backend, disaggregation_bootstrap_port=port, host=HOST,
        )
    )  # fmt: skip
    _parallel_context()
    moved.install()  # bytes and descriptors per request, at the engine call (both backends)
    if backend == "mooncake":  # as SGLang's scheduler does for its own Mooncake backend
        _mooncake_engine()
    if s.key() not in S.pools:
        S.pools[s.key()] = pools.build(s, hold_pages=1 if role == "decode" else 0)
    S.cur = S.pools[s.key()]
    prefill = role == "prefill"
    S.args = pools.kv_args(S.cur, backend, prefill=prefill)
    for _, ptr, length, _ in pools.buffers(S.args):
        pattern.memory(ptr, length).fill(pattern.FOREIGN if prefill else pattern.SENTINEL)
    tb = TransferBackend(backend)
    if prefill and port not in S.servers:
        S.servers[port] = get_kv_class(tb, KVClassType.BOOTSTRAP_SERVER)(HOST, port)
    from sglang.srt.runtime_context import get_context

    mode = DisaggregationMode.PREFILL if prefill else DisaggregationMode.DECODE
    try:
        S.mgr = get_kv_class(tb, KVClassType.MANAGER)(S.args, mode, get_context().server_args, True)
    finally:
        if verify:
            os.environ.pop("PDSTATE_TRANSFER__VERIFY", None)
    S.sessions[session] = {k: getattr(S, k) for k in SESSION}
    return {
        "buffers": len(pools.buffers(S.args)),
        "state_types": [str(t.value) for t in S.args.state_types],
        "sglang": boot.release(),
    }


def use(backend: str) -> dict:
    """Make the last ``setup`` of ``backend`` current again (its pools, KVArgs and manager)."""
    for k, v in S.sessions[backend].items():
        setattr(S, k, v)
    return {}


def _poll(until: tuple, deadline: float) -> tuple[str, float]:
    while True:
        state = S.conn.poll()
        now = time.perf_counter()
        if state in until or state == KVPoll.Failed:
            return STATES.get(state, str(state)), now
        if now >= deadline:
            return f"timeout ({STATES.get(state, state)})", now
        time.sleep(POLL_S)


def _failure() -> str | None:
    try:
        S.conn.failure_exception()
    except Exception as exc:  # the failure's text is the point
        return error_text(exc)
    return None


def _end(outcome: str) -> str | None:
    failure = _failure() if outcome == "Failed" else None
    if outcome != "Success" and outcome != "Failed":
        try:
            S.conn.abort()
        except Exception as exc:  # recorded, not raised: the request is over either way
            failure = f"abort: {error_text(exc)}"
    if S.req is not None:
        pools.release(S.cur, S.req)
    return failure


# -- prefill
def open_request(room: int, tokens: int) -> dict:
    moved.reset()
    S.req = pools.allocate(S.cur, S.args, room, tokens, PREFILL_SLOT)
    items = pools.request_items(S.cur, S.args, S.req, PREFILL_SLOT)
    for (_, ptr, length, _), (_, item_len, keys) in zip(pools.buffers(S.args), items):
        pattern.write_items(pattern.memory(ptr, length), item_len, keys)
    cls = get_kv_class(TransferBackend(S.backend), KVClassType.SENDER)
    if boot.row().keyword_api:  # the prefill's own call (0.5.23): keywords, no dest_tp_ranks / pp_rank
        S.conn = cls(mgr=S.mgr, bootstrap_addr=S.addr, bootstrap_room=room, req_has_disagg_prefill_dp_rank=False)
    else:
        S.conn = cls(S.mgr, S.addr, room, [0], 0)
    S.conn.init(len(S.req.pages), PREFILL_SLOT)
    return {"pages": len(S.req.pages)}


def send(deadline_s: float) -> dict:
    deadline = time.perf_counter() + deadline_s
    state, _ = _poll((KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success), deadline)
    if state not in ("WaitingForInput", "Transferring"):
        return {"outcome": state, "failure": _end(state), "ms": None}
    pages, first = S.req.pages, len(S.req.pages) // 2
    t0 = time.perf_counter()
    if first:  # two chunks; a one-page request is one, as SGLang's prefill sends it
        S.conn.send(pages[:first], None)
    S.conn.send(pages[first:], S.req.state_indices)
    state, t1 = _poll((KVPoll.Success,), deadline)
    out = {"outcome": state, "failure": _end(state), "ms": (t1 - t0) * 1000 if state == "Success" else None}
    out["moved"] = moved.read()
    return out


# -- decode
def recv(room: int, tokens: int, deadline_s: float) -> dict:
    deadline = time.perf_counter() + deadline_s
    moved.reset()
    for _, ptr, length, _ in pools.buffers(S.args):
        pattern.memory(ptr, length).fill(pattern.SENTINEL)
    try:
        while not S.mgr.try_ensure_parallel_info(S.addr):
            if time.perf_counter() >= deadline:
                return {"outcome": "timeout (no parallel info)", "failure": None}
            time.sleep(0.01)
    except Exception as exc:  # SGLang's own refusal (page size, dtype) raises here
        return {"outcome": "refused", "failure": error_text(exc)}
    S.req = pools.allocate(S.cur, S.args, room, tokens, DECODE_SLOT)
    cls = get_kv_class(TransferBackend(S.backend), KVClassType.RECEIVER)
    S.conn = cls(S.mgr, S.addr, room)
    S.conn.init(0)
    S.metadata_at = time.perf_counter()  # the decode's metadata -> Success: what the first token waits for
    S.conn.send_metadata(S.req.pages, DECODE_SLOT, S.req.state_indices, decode_prefix_len=0)
    return {"outcome": "sent", "failure": None}


def wait(deadline_s: float) -> dict:
    deadline = time.perf_counter() + deadline_s
    state, t1 = _poll((KVPoll.Success,), deadline)
    out = {"outcome": state, "bytes_checked": 0, "items": 0, "wrong_items": 0, "outside_bytes": 0, "changed_bytes": 0}
    wrong_by = {}
    items = pools.request_items(S.cur, S.args, S.req, DECODE_SLOT)
    for (what, ptr, length, _), (_, item_len, keys) in zip(pools.buffers(S.args), items):
        view = pattern.memory(ptr, length)
        checked, wrong, outside = pattern.check_buffer(view, item_len, keys)
        out["bytes_checked"] += checked
        out["items"] += len(keys)
        out["wrong_items"] += wrong
        out["outside_bytes"] += outside
        out["changed_bytes"] += pattern.changed_bytes(view)
        kind = what if what in ("main", "aux") else "state"
        wrong_by[kind] = wrong_by.get(kind, 0) + wrong
    out["wrong_by"] = wrong_by
    out["ms"] = (t1 - S.metadata_at) * 1000 if state == "Success" else None
    out["moved"] = moved.read()
    out["failure"] = _end(state)
    return out


def main() -> None:
    ops = {"setup": setup, "use": use, "open": open_request, "send": send, "recv": recv, "wait": wait}
    ops.update(trace_on=tracing.on, trace_off=tracing.off, spans=tracing.spans)  # SGLang's tracing, recorded
    serve(ops, REPLY, trace_chars=3000)


if __name__ == "__main__":
    main()
