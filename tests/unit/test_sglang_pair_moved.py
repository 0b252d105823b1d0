"""``devtools.sglang_pair.moved``: bytes and descriptors counted at the engine call, on a stand-in
for Mooncake's ``TransferEngine`` (the real one is wrapped in the SGLang pair's children:
``tests/sglang/test_bench_phase.py``)."""

from __future__ import annotations

import threading

from pdstate.devtools.sglang_pair import moved


class FakeEngine:
    """The binding's signatures: target, buffer(s), peer address(es), length(s); returns 0."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def batch_transfer_sync_write(self, target, buffers, peers, lengths, transport_hint=""):
        self.calls.append(("batch", target, list(lengths)))
        return 0

    def transfer_sync_write(self, target, buffer, peer, length, transport_hint=""):
        self.calls.append(("one", target, length))
        return 0

    def register_memory(self, ptr, length):  # not a transfer: not counted
        return 0


def test_every_transfer_call_counts_its_lengths_and_entries_and_still_runs():
    class Engine(FakeEngine):
        pass

    assert moved.wrap_class(Engine) == ["batch_transfer_sync_write", "transfer_sync_write"]
    e = Engine()
    moved.reset()
    assert e.batch_transfer_sync_write("peer", [1, 2, 3], [4, 5, 6], [100, 200, 300]) == 0
    assert e.transfer_sync_write("peer", 7, 8, length=24) == 0
    assert e.register_memory(1, 4096) == 0
    assert e.calls == [("batch", "peer", [100, 200, 300]), ("one", "peer", 24)]
    assert moved.read() == {"bytes": 624, "descriptors": 4, "calls": 2}
    moved.reset()
    assert moved.read() == {"bytes": 0, "descriptors": 0, "calls": 0}


def test_calls_from_many_threads_all_count():
    class Engine(FakeEngine):
        pass

    moved.wrap_class(Engine)
    e = Engine()
    moved.reset()
    threads = [
        threading.Thread(
            target=lambda: [e.batch_transfer_sync_write("p", [0] * 2, [0] * 2, [8, 8]) for _ in range(500)]
        )
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert moved.read() == {"bytes": 4 * 500 * 16, "descriptors": 4 * 500 * 2, "calls": 2000}
