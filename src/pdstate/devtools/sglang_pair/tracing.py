"""SGLang's request tracing in a child of the pair driver, its spans recorded in the child.

SGLang's ``observability.trace`` exports through OpenTelemetry's SDK and an OTLP collector; the
driver has neither. ``on(modules)`` does what ``process_tracing_init`` does with
``--trace-modules modules`` (``None``: no filter), with a tracer that records each span (name,
parent, times, attributes) instead of exporting it, and turns ``--enable-trace`` on through the
observability bag's scoped override (SGLang's test hook: call it after ``setup``, which publishes
the server args anew); ``spans()`` returns what ended since the
last call; ``off()`` puts everything back. Every call of ``TraceReqContext`` is SGLang's own.
"""

from __future__ import annotations

import itertools
from typing import Any

from opentelemetry import trace as otel

_SAVED = ("opentelemetry_initialized", "tracer", "_trace_context_propagator", "global_trace_modules")


class RecordedSpan(otel.Span):
    """One span as SGLang's tracing drives it; ``row()`` is what the parent gets."""

    def __init__(self, recorder: Recorder, name: str, start: int | None, parent: RecordedSpan | None, attrs) -> None:
        self.recorder, self.name, self.start, self.parent = recorder, name, start, parent
        self.end_time: int | None = None
        self.attributes = dict(attrs or {})
        self.span_id = next(recorder.ids)
        self.context = otel.SpanContext(trace_id=1, span_id=self.span_id, is_remote=False)

    def row(self) -> dict:
        return {
            "id": self.span_id,
            "name": self.name,
            "parent": None if self.parent is None else self.parent.span_id,
            "start": self.start,
            "end": self.end_time,
            "attributes": {k: str(v) for k, v in self.attributes.items()},
        }

    def end(self, end_time: int | None = None) -> None:
        self.end_time = end_time
        self.recorder.ended.append(self)

    def get_span_context(self) -> otel.SpanContext:
        return self.context

    def set_attributes(self, attributes) -> None:
        self.attributes.update(attributes)

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def add_event(self, name: str, attributes=None, timestamp: int | None = None) -> None:
        pass

    def add_link(self, context, attributes=None) -> None:
        pass

    def update_name(self, name: str) -> None:
        self.name = name

    def is_recording(self) -> bool:
        return True

    def set_status(self, status, description: str | None = None) -> None:
        self.attributes["status"] = status

    def record_exception(self, exception, attributes=None, timestamp=None, escaped=False) -> None:
        pass


class Recorder:
    """The tracer SGLang's ``observability.trace`` starts its spans with."""

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.ended: list[RecordedSpan] = []

    def start_span(self, name: str, context=None, kind=None, attributes=None, links=None, start_time=None, **_):
        parent = otel.get_current_span(context) if context is not None else None
        return RecordedSpan(self, name, start_time, parent if isinstance(parent, RecordedSpan) else None, attributes)


_state: dict[str, Any] = {}


def on(modules: str | None = None, enable: bool = True) -> dict:
    """Tracing on in this process, spans recorded; ``modules``: ``--trace-modules``' value;
    ``enable=False``: the tracer in place, but ``--enable-trace`` left as it is (off)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    from sglang.srt.observability import trace as sglang_trace
    from sglang.srt.runtime_context import get_observability

    if _state:
        off()
    scope = get_observability().override(enable_trace=enable)  # the bag of the last ``setup``'s server args
    scope.__enter__()
    _state.update(scope=scope, saved={name: getattr(sglang_trace, name) for name in _SAVED}, recorder=Recorder())
    sglang_trace.opentelemetry_initialized = True
    sglang_trace.tracer = _state["recorder"]
    sglang_trace._trace_context_propagator = TraceContextTextMapPropagator()
    sglang_trace.global_trace_modules = [m.strip() for m in modules.split(",") if m.strip()] if modules else None
    return {}


def spans() -> dict:
    """The spans that ended since the last call, in the order they ended."""
    recorder = _state.get("recorder")
    if recorder is None:
        return {"spans": []}
    ended, recorder.ended = recorder.ended, []
    return {"spans": [s.row() for s in ended]}


def off() -> dict:
    """Tracing as it was before ``on``."""
    from sglang.srt.observability import trace as sglang_trace

    if not _state:
        return {}
    _state["scope"].__exit__(None, None, None)
    for name, value in _state["saved"].items():
        setattr(sglang_trace, name, value)
    _state.clear()
    return {}
