"""Mooncake specifics: bogus sessions fail fast, native codes become messages naming the chunk."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from pdstate.pools.memory import BufferSpec, PrivateMemory
from pdstate.transfer.engines import EngineError, NativeEngineError
from pdstate.transfer.engines.mooncake import MooncakeEngine
from pdstate.transfer.plan import TransferPlan
from tests.support.bounds import within
from tests.support.engines import ENGINE_OPTIONS, require_engine
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(30)]


@pytest.fixture(scope="module", autouse=True)
def _available() -> None:
    require_engine("mooncake")


@pytest.fixture
def rig() -> Iterator:
    """Both sides in this process (Mooncake talks TCP to itself just the same)."""
    memory = PrivateMemory()
    (src,) = memory.allocate("src", [BufferSpec("b", (1 << 20,), torch.uint8)])
    (dst,) = memory.allocate("dst", [BufferSpec("b", (1 << 20,), torch.uint8)])
    src_region, dst_region = memory.regions()
    made: list[MooncakeEngine] = []

    def make(**options) -> MooncakeEngine:
        made.append(MooncakeEngine(**{**ENGINE_OPTIONS["mooncake"], **options}))
        made[-1].start()
        return made[-1]

    decode = make()
    decode.register([dst_region])
    yield make, decode, src_region, dst_region
    for e in made:
        e.close()


def _bogus(endpoint: dict) -> dict:
    return {**endpoint, "session_id": "127.0.0.1:1"}


def test_bogus_session_fails_at_connect(rig) -> None:
    make, decode, src_region, _ = rig
    prefill = make()
    started = time.monotonic()
    with pytest.raises(NativeEngineError, match=r"^mooncake send_probe to 127.0.0.1:1 \(connect\) failed: code -\d+$"):
        prefill.connect(_bogus(decode.endpoint()))
    within("mooncake: a bogus session's connect failing", time.monotonic() - started, 5.0, 0.2)


@pytest.mark.parametrize(
    ("completion", "op"), [("poll", "transfer_submit_write"), ("sync", "batch_transfer_sync_write")]
)
def test_failed_batch_names_peer_chunk_and_code(rig, completion: str, op: str) -> None:
    make, decode, src_region, dst_region = rig
    prefill = make(probe_on_connect=False, max_batch_descriptors=1000, completion=completion)
    prefill.register([src_region])
    peer = prefill.connect(_bogus(decode.endpoint()))  # no probe: the failure comes from the write
    n = 2500
    offsets = np.arange(n, dtype=np.uint64) * 64
    plan = TransferPlan.from_arrays(src_region.base_ptr + offsets, dst_region.base_ptr + offsets, np.full(n, 64))
    handle = prefill.submit(peer, plan)
    with pytest.raises(NativeEngineError) as info:
        prefill.wait(handle, 10.0)
    assert str(info.value) == (
        f"mooncake {op} to 127.0.0.1:1 failed on chunk 1 of 3 (descriptors 0..999, 64000 bytes): code {info.value.code}"
    )
    assert info.value.code < 0


def test_closed_engine_fails_queued_work_and_refuses_more(rig) -> None:
    make, decode, src_region, dst_region = rig
    prefill = make()
    prefill.register([src_region])
    peer = prefill.connect(decode.endpoint())
    plan = TransferPlan.from_arrays([src_region.base_ptr], [dst_region.base_ptr], [4096])
    prefill.wait(prefill.submit(peer, plan), 10.0)
    prefill.close()
    with pytest.raises(EngineError, match="called while closed"):
        prefill.submit(peer, plan)


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="max_batch_descriptors must be >= 1"):
        MooncakeEngine(max_batch_descriptors=0)
    with pytest.raises(ValueError, match="^completion must be one of poll, sync, got 'spin'$"):
        MooncakeEngine(completion="spin")
    with pytest.raises(ValueError, match="^poll_interval_s must be > 0, got 0$"):
        MooncakeEngine(poll_interval_s=0)


def test_on_done_fires_once_after_the_write_also_on_failure(rig) -> None:
    make, decode, src_region, dst_region = rig
    prefill = make()
    prefill.register([src_region])
    peer = prefill.connect(decode.endpoint())
    src = np.frombuffer((ctypes.c_uint8 * (1 << 20)).from_address(src_region.base_ptr), dtype=np.uint8)
    dst = np.frombuffer((ctypes.c_uint8 * (1 << 20)).from_address(dst_region.base_ptr), dtype=np.uint8)
    src[:] = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8) ^ 0x5A
    dst[:] = 0
    plan = TransferPlan.from_arrays([src_region.base_ptr], [dst_region.base_ptr], [1 << 20])
    handle = prefill.submit(peer, plan)
    landed: list[bytes] = []
    fired = threading.Event()

    def done() -> None:  # on the engine's worker: the bytes are there already
        landed.append(dst.tobytes())
        fired.set()

    prefill.on_done(handle, done)
    assert fired.wait(10.0)
    assert prefill.poll(handle) is True
    assert landed == [src.tobytes()]
    later: list[int] = []
    prefill.on_done(handle, lambda: later.append(1))  # already finished (and polled): at once
    assert later == [1] and len(landed) == 1

    bogus = make(probe_on_connect=False)
    bogus.register([src_region])
    failing = bogus.submit(bogus.connect(_bogus(decode.endpoint())), plan)
    failed = threading.Event()
    bogus.on_done(failing, failed.set)
    assert failed.wait(20.0)
    with pytest.raises(NativeEngineError, match=r"^mooncake transfer_submit_write to 127\.0\.0\.1:1 failed"):
        bogus.poll(failing)


def _views(src_region, dst_region) -> tuple[np.ndarray, np.ndarray]:
    src = np.frombuffer((ctypes.c_uint8 * (1 << 20)).from_address(src_region.base_ptr), dtype=np.uint8)
    dst = np.frombuffer((ctypes.c_uint8 * (1 << 20)).from_address(dst_region.base_ptr), dtype=np.uint8)
    return src, dst


@pytest.mark.parametrize("completion", ["poll", "sync"])
def test_windows_land_every_byte_where_planned(rig, completion: str) -> None:
    """A plan of 300 scattered descriptors in windows of 64 (the last one short): every byte
    lands at its planned offset and nothing else of the destination changes."""
    make, decode, src_region, dst_region = rig
    prefill = make(max_batch_descriptors=64, completion=completion)
    prefill.register([src_region])
    peer = prefill.connect(decode.endpoint())
    src, dst = _views(src_region, dst_region)
    rng = np.random.default_rng(37)
    src[:] = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst[:] = 0xEE
    n, size = 300, 1000
    src_off = rng.permutation(1000)[:n].astype(np.uint64) * size
    dst_off = rng.permutation(1000)[:n].astype(np.uint64) * size
    plan = TransferPlan.from_arrays(src_region.base_ptr + src_off, dst_region.base_ptr + dst_off, np.full(n, size))
    prefill.wait(prefill.submit(peer, plan), 20.0)
    expected = np.full(1 << 20, 0xEE, dtype=np.uint8)
    for s_, d_ in zip(src_off.tolist(), dst_off.tolist()):
        expected[d_ : d_ + size] = src[s_ : s_ + size]
    assert dst.tobytes() == expected.tobytes()


class _StatusOf:
    """The engine's native with ``transfer_check_status`` scripted: the descriptor submitted
    ``failing``-th ends with code -1; every other one reports "moving" twice before its real
    status. Records each status asked for (the ids, in order) and each one that ended."""

    def __init__(self, native, failing: int) -> None:
        self.native, self.failing = native, failing
        self.ids: list[int] = []
        self.asked: dict[int, int] = {}
        self.ended: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self.native, name)

    def transfer_submit_write(self, *args):
        batch = self.native.transfer_submit_write(*args)
        self.ids.append(batch)
        return batch

    def transfer_check_status(self, batch: int) -> int:
        self.asked[batch] = self.asked.get(batch, 0) + 1
        if self.asked[batch] <= 2:
            return 0
        rc = self.native.transfer_check_status(batch)
        if rc == 0:
            return 0
        self.ended.append(batch)
        return -1 if batch == self.ids[self.failing] else rc


def test_a_failed_descriptor_is_reported_once_every_one_submitted_ended(rig) -> None:
    make, decode, src_region, dst_region = rig
    prefill = make(max_batch_descriptors=8)
    prefill.register([src_region])
    peer = prefill.connect(decode.endpoint())
    scripted = _StatusOf(prefill.native, failing=3)
    prefill.native = scripted  # the engine calls what ``native`` names
    offsets = np.arange(20, dtype=np.uint64) * 4096
    plan = TransferPlan.from_arrays(src_region.base_ptr + offsets, dst_region.base_ptr + offsets, np.full(20, 4096))
    handle = prefill.submit(peer, plan)
    with pytest.raises(NativeEngineError) as info:
        prefill.wait(handle, 20.0)
    assert str(info.value) == (
        f"mooncake transfer_check_status to {decode.endpoint()['session_id']} failed on chunk 1 of 3 "
        "(descriptors 0..7, 32768 bytes): code -1"
    )
    assert info.value.code == -1
    assert len(scripted.ids) == 8  # the first window only: no later window is submitted
    assert scripted.ended == scripted.ids  # each one submitted ended (and was freed) before the error


class _Held(_StatusOf):
    """Every descriptor reports "moving" until ``release`` is set, then its real status."""

    def __init__(self, native) -> None:
        super().__init__(native, failing=-1)
        self.release = threading.Event()

    def transfer_check_status(self, batch: int) -> int:
        if not self.release.is_set():
            return 0
        rc = self.native.transfer_check_status(batch)
        if rc != 0:
            self.ended.append(batch)
        return rc


def test_a_timed_out_window_frees_its_descriptors_once_they_end(rig, monkeypatch) -> None:
    """The window's deadline passed at once (the native's timeout taken as already over): the
    write fails with -2 while its descriptors still report moving; once they may end, the worker
    checks them until each one ended (the check that sees it end frees its batch id), and every
    byte landed."""
    from pdstate.transfer.engines import mooncake

    make, decode, src_region, dst_region = rig
    prefill = make(max_batch_descriptors=8)
    prefill.register([src_region])
    peer = prefill.connect(decode.endpoint())
    slow = _Held(prefill.native)
    prefill.native = slow
    monkeypatch.setattr(mooncake, "transfer_timeout_s", lambda: -60.0)
    src, dst = _views(src_region, dst_region)
    src[:] = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
    dst[:] = 0
    offsets = np.arange(6, dtype=np.uint64) * 8192
    plan = TransferPlan.from_arrays(src_region.base_ptr + offsets, dst_region.base_ptr + offsets, np.full(6, 4096))
    with pytest.raises(NativeEngineError) as info:
        prefill.wait(prefill.submit(peer, plan), 20.0)
    assert info.value.code == -2 and "failed on chunk 1 of 1 (descriptors 0..5, 24576 bytes)" in str(info.value)
    assert len(slow.ids) == 6 and slow.ended == [] and prefill.unended_batches == 6
    slow.release.set()  # the descriptors may end now
    wait_until("the timed-out window's descriptors to end", lambda: prefill.unended_batches == 0)
    assert sorted(slow.ended) == sorted(slow.ids)  # each one seen ending: freed by that check
    for off in offsets.tolist():
        assert dst[off : off + 4096].tobytes() == src[off : off + 4096].tobytes()
    assert not dst[4096:8192].any()


def test_the_raw_rows_write_land_every_byte(rig) -> None:
    """The bench's raw Mooncake rows (``baselines.raw_mooncake_write``), sync then polled: a plan
    of 2,100 descriptors (two windows) lands exactly, and nothing else changes."""
    from pdstate.devtools.baselines import raw_mooncake_write

    make, decode, src_region, dst_region = rig
    prefill = make()
    prefill.register([src_region])
    endpoint = decode.endpoint()
    prefill.connect(endpoint)
    src, dst = _views(src_region, dst_region)
    src[:] = np.random.default_rng(9).integers(0, 256, 1 << 20, dtype=np.uint8)
    n, size = 2100, 240  # 2,100 x 480 bytes: within the 1 MiB buffers
    offsets = np.arange(n, dtype=np.uint64) * 2 * size  # every other slot
    plan = TransferPlan.from_arrays(src_region.base_ptr + offsets, dst_region.base_ptr + offsets, np.full(n, size))
    expected = np.full(1 << 20, 0xEE, dtype=np.uint8)
    for off in offsets.tolist():
        expected[off : off + size] = src[off : off + size]
    for polled in (False, True):
        dst[:] = 0xEE
        raw_mooncake_write(prefill.native, str(endpoint["session_id"]), plan, polled=polled)()
        assert dst.tobytes() == expected.tobytes(), f"polled={polled}"
