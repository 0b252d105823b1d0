"""The phases of a traced request, from its agent requests' stage times (``integrations.sglang.trace.phases``)."""

from __future__ import annotations

from pdstate.integrations.sglang.trace import phases

SENT = {"waiting_for_input_at_s": 0.5, "transferring_at_s": 0.75, "transfer_s": 1.0, "success_at_s": 2.0}


def test_a_sender_that_succeeded_has_every_phase_back_to_back() -> None:
    assert phases([SENT], sender=True) == [
        ("pdstate_bootstrap", None, 0.5),
        ("pdstate_forward_wait", 0.5, 0.75),
        ("pdstate_wire", 0.75, 1.75),
        ("pdstate_verify", 1.75, 2.0),
    ]


def test_a_receiver_names_its_allocation_wait_and_several_agents_take_the_latest() -> None:
    later = {**SENT, "transferring_at_s": 1.0, "success_at_s": 2.5}
    assert phases([SENT, later], sender=False) == [
        ("pdstate_bootstrap", None, 0.5),
        ("pdstate_allocation_wait", 0.5, 1.0),
        ("pdstate_wire", 1.0, 2.0),
        ("pdstate_verify", 2.0, 2.5),
    ]


def test_a_failed_request_has_the_phases_it_reached_the_last_ending_at_the_failure() -> None:
    failed = {"waiting_for_input_at_s": 0.5, "failed_at_s": 3.0}
    assert phases([failed], sender=False) == [("pdstate_bootstrap", None, 0.5), ("pdstate_allocation_wait", 0.5, 3.0)]


def test_no_times_no_phases() -> None:
    assert phases([], sender=True) == []
    assert phases([{"waiting_for_input_at_s": 0.5}], sender=True) == []  # not ended: nothing to trace yet


class _Unhashable:
    """A side that fails on anything beyond tracing's switch: hashing it (the once-only set), its
    metrics (the phases)."""

    __hash__ = None  # type: ignore[assignment]
    bootstrap_room = 7

    def __init__(self, ctx=None, kv_mgr=None) -> None:
        self.trace_ctx, self.kv_mgr = ctx, kv_mgr

    def pdstate_metrics(self):
        raise AssertionError("tracing off: the metrics are not read")


class _Sender(_Unhashable):
    pass


class _Receiver(_Unhashable):
    pass


class _HashableReceiver(_Receiver):
    __hash__ = object.__hash__


def test_tracing_off_returns_after_the_switch_alone(monkeypatch, caplog) -> None:
    """A request's last poll (SGLang's scheduler thread) comes through ``finish``: with tracing
    off it reads the switch and returns, never the once-only set or the metrics (either would
    raise here, and ``finish`` would log it)."""
    import types

    from pdstate.integrations.sglang import trace

    monkeypatch.setitem(trace._SENDER_CLASSES, _Sender, True)
    monkeypatch.setitem(trace._SENDER_CLASSES, _Receiver, False)
    observability = types.SimpleNamespace(enable_trace=False)
    monkeypatch.setattr(trace, "_GET_OBSERVABILITY", [lambda: observability])
    caplog.set_level("ERROR", logger="pdstate.integrations.sglang")
    sides = [
        _Sender(),  # no context: SGLang 0.5.19, or a module filtered out
        _Sender(types.SimpleNamespace(tracing_enable=False)),
        _Receiver(kv_mgr=types.SimpleNamespace()),  # 0.5.19: no sender_trace_module
        _Receiver(kv_mgr=types.SimpleNamespace(sender_trace_module="pdstate")),  # --enable-trace off
    ]
    for side in sides:
        trace.finish(side, failed=False)
        trace.finish(side, failed=True)
    assert caplog.records == []
    # switched on: the receiver's trace is written (here: the context cannot be opened, logged)
    observability.enable_trace = True
    on = _HashableReceiver(kv_mgr=sides[3].kv_mgr)
    monkeypatch.setitem(trace._SENDER_CLASSES, _HashableReceiver, False)
    monkeypatch.setattr(trace, "_receiver_context", lambda side: 1 / 0)
    trace.finish(on, failed=False)
    assert [r.getMessage() for r in caplog.records] == ["pdstate: room 7: its trace could not be written"]
