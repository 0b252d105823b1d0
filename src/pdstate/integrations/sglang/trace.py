"""SGLang trace slices for pdstate's transfers: one request's timeline, its phases as spans.

SGLang 0.5.23 traces a backend's senders when its KV manager names a trace module
(``CommonKVManager.sender_trace_module``; SGLang's Mooncake names ``"mooncake"``): with
``--enable-trace`` (and the module in ``--trace-modules`` when that filter is given) its
``CommonKVSender`` opens a ``TraceReqContext`` per request (root span ``Sender Req <room>``) and
ends it when the request ends. pdstate's manager names ``"pdstate"`` (``TRACE_MODULE``); when one
of pdstate's requests ends (Success or Failed: ``states.conclude`` / ``conclude_failed``, or
SGLang's ``failure_exception`` after a failure of its own, such as its timeouts),
``finish`` adds its phases to that context as level-1 slices, one after another, then ends it. A
decode rank's receiver gets the same: SGLang opens no context for receivers, so ``finish`` opens one
(role ``Receiver``, the same module, the same switches), from the time its agent request began.

The phases, from the agent requests' own stage times (``KVSender.metrics`` / ``KVReceiver.metrics``:
``*_at_s`` and ``transfer_s``; with several agent requests behind one SGLang request, the latest of
each), anchored where SGLang sees the request end:

========================== =============================================== ==========================================
span                       prefill (sender)                                decode (receiver)
========================== =============================================== ==========================================
``pdstate_bootstrap``      sender made -> the decode's request arrived      receiver made -> handshake accepted
``pdstate_allocation_wait`` (not on a prefill: the decode asks once it has  accepted -> the pages named (SGLang's
                           allocated, inside ``pdstate_bootstrap``)         ``send_metadata``: allocation done)
``pdstate_forward_wait``   the request arrived -> its first chunk          (not on a decode)
``pdstate_wire``           first chunk -> every chunk landed               pages named -> every chunk landed
``pdstate_verify``         landed -> the decode's verdict (digests)         landed -> digests compared
========================== =============================================== ==========================================

A request that failed has the phases it reached, the last one ending at the failure (one that
failed before it had an agent request: ``pdstate_bootstrap`` alone; one SGLang failed while its
agent requests went on, such as its timeouts: no slices), and its root span carries
``pdstate.outcome`` ``failed``. With tracing off, on SGLang 0.5.19 (no
``sender_trace_module``: SGLang opens no context for a backend), or without OpenTelemetry,
nothing is traced and ``finish`` returns after one look.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

log = logging.getLogger("pdstate.integrations.sglang")

__all__ = ["LEVEL", "TRACE_MODULE", "finish", "phases", "wanted"]

TRACE_MODULE = "pdstate"  # what ``--trace-modules`` names to keep pdstate's spans
LEVEL = 1  # SGLang's level of a backend's transfer slices (``SGLANG_TRACE_LEVEL`` >= 1 shows them)

BOOTSTRAP, ALLOCATION_WAIT, FORWARD_WAIT = "pdstate_bootstrap", "pdstate_allocation_wait", "pdstate_forward_wait"
WIRE, VERIFY = "pdstate_wire", "pdstate_verify"
# each side's phases, in order, and the agent metric that ends each (``None``: the request's end)
SENDER_PHASES = (
    (BOOTSTRAP, "waiting_for_input_at_s"),
    (FORWARD_WAIT, "transferring_at_s"),
    (WIRE, "wire"),
    (VERIFY, None),
)
RECEIVER_PHASES = (
    (BOOTSTRAP, "waiting_for_input_at_s"),
    (ALLOCATION_WAIT, "transferring_at_s"),
    (WIRE, "wire"),
    (VERIFY, None),
)

_finished: weakref.WeakSet = weakref.WeakSet()  # the sides whose timeline went out (once each)


def phases(metrics: list[dict], sender: bool) -> list[tuple[str, float | None, float]]:
    """``[(span, start_s, end_s)]``: the phases one request reached, in seconds since its agent
    request(s) began (``start_s`` ``None``: the first phase, which starts when SGLang's side was
    made); ``metrics``: its agent requests' metrics. Pure: the times come in."""
    if not metrics:
        return []
    ended = [m.get("success_at_s", m.get("failed_at_s")) for m in metrics]
    if any(t is None for t in ended):
        return []
    end = max(ended)

    def latest(key: str) -> float | None:
        if key == "wire":  # the wire starts with the phase before it ends; it lasts ``transfer_s``
            starts = [m.get("transferring_at_s") for m in metrics]
            lasts = [m.get("transfer_s") for m in metrics]
            if any(s is None for s in starts) or any(t is None for t in lasts):
                return None
            return max(s + t for s, t in zip(starts, lasts))
        values = [m.get(key) for m in metrics]
        return None if any(v is None for v in values) else max(values)

    out: list[tuple[str, float | None, float]] = []
    start: float | None = None
    for name, key in SENDER_PHASES if sender else RECEIVER_PHASES:
        stop = end if key is None else latest(key)
        if stop is None:  # not reached: the failure ends the phase it was in
            out.append((name, start, end))
            break
        stop = min(max(stop, start or 0.0), end)
        out.append((name, start, stop))
        start = stop
    return out


def finish(side, failed: bool) -> None:
    """Trace the request of ``side`` (pdstate's SGLang sender or receiver) once, when it ends. A
    trace that cannot be written is logged, never raised: the request's outcome stands.

    Tracing off costs a constant few attribute reads (a request's last poll, on SGLang's
    scheduler thread, comes here): a sender whose context SGLang did not enable, a receiver on an
    SGLang without ``sender_trace_module`` (0.5.19) or with ``--enable-trace`` off, returns before
    anything else is looked at."""
    try:
        if _is_sender(side):
            ctx = getattr(side, "trace_ctx", None)
            if ctx is None or not getattr(ctx, "tracing_enable", False):
                return
        elif not _receiver_traced(side):
            return
        if side in _finished:
            return
        _finish(side, failed)
    except Exception:  # tracing is a side channel: SGLang's request goes on whatever it does
        _finished.add(side)
        log.exception("pdstate: room %s: its trace could not be written", getattr(side, "bootstrap_room", "?"))


def wanted(side) -> bool:
    """Whether a request of ``side`` (pdstate's SGLang receiver) made now is traced when it ends
    (tracing on, on an SGLang that traces its backends). Read once per request where its agent
    request is made (the agent's thread, for a one-stage prefill), as SGLang reads the switch once
    per sender (its trace context, opened when the sender is made): its Success on the scheduler
    thread then asks nothing more when it is off. Any doubt reads True (``finish`` decides)."""
    try:
        return _receiver_traced(side)
    except Exception:  # tracing is a side channel: ``finish`` looks again, and logs what it finds
        return True


def _receiver_traced(side) -> bool:
    """Whether a receiver's requests are traced now: an SGLang that traces its backends
    (``sender_trace_module``, 0.5.23), with ``--enable-trace`` on."""
    return bool(getattr(side.kv_mgr, "sender_trace_module", None)) and bool(_observability().enable_trace)


def _finish(side, failed: bool) -> None:
    sender = _is_sender(side)
    ctx = getattr(side, "trace_ctx", None) if sender else _receiver_context(side)
    if ctx is None or not getattr(ctx, "tracing_enable", False):
        return
    _finished.add(side)
    metrics = side.pdstate_metrics()
    now_ns = time.time_ns()
    began_ns = now_ns - int(_end_s(metrics) * 1e9)  # when the agent request(s) began
    if not sender:
        ctx.trace_req_start(ts=began_ns)
    first_ns = ctx.start_time_ns if sender else began_ns
    # no agent request (refused before the decode's request came, or before one was made): it
    # ended in its bootstrap; agent requests not ended (SGLang failed it first): no times to place
    for name, start_s, end_s in phases(metrics, sender) if metrics else [(BOOTSTRAP, None, 0.0)]:
        start_ns = first_ns if start_s is None else began_ns + int(start_s * 1e9)
        end_ns = max(start_ns, began_ns + int(end_s * 1e9))
        ctx.trace_slice_start(name, LEVEL, ts=start_ns)
        ctx.trace_slice_end(name, LEVEL, ts=end_ns)
    ctx.trace_req_finish(attrs={"pdstate.outcome": "failed" if failed else "success"})


def _end_s(metrics: list[dict]) -> float:
    ended = [m.get("success_at_s", m.get("failed_at_s")) for m in metrics]
    return max((t for t in ended if t is not None), default=0.0)


_SENDER_CLASSES: dict[type, bool] = {}  # a side's class -> whether it is a sender (looked up once)


def _is_sender(side) -> bool:
    """Whether ``side`` is a sender (its class looked up once: a request's last poll, on SGLang's
    scheduler thread, comes here)."""
    cls = type(side)
    sender = _SENDER_CLASSES.get(cls)
    if sender is None:
        from sglang.srt.disaggregation.base.conn import BaseKVSender

        sender = _SENDER_CLASSES[cls] = issubclass(cls, BaseKVSender)
    return sender


_GET_OBSERVABILITY: list = []  # SGLang's ``runtime_context.get_observability`` (imported once)


def _observability() -> Any:
    """SGLang's observability settings (``enable_trace``: read on each call, a test may switch it)."""
    if not _GET_OBSERVABILITY:
        from sglang.srt.runtime_context import get_observability

        _GET_OBSERVABILITY.append(get_observability)
    return _GET_OBSERVABILITY[0]()


def _receiver_context(side) -> Any:
    """A receiver's trace context, opened as SGLang opens a sender's, or ``None``: tracing off, or
    an SGLang without ``sender_trace_module`` (0.5.19)."""
    module = getattr(side.kv_mgr, "sender_trace_module", None)
    if not module or not _observability().enable_trace:
        return None
    from sglang.srt.observability.trace import TraceReqContext

    room = side.bootstrap_room
    return TraceReqContext(rid=str(hex(room)), bootstrap_room=room, role="Receiver", module_name=module)
