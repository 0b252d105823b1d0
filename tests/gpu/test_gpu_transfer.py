"""Pools on a GPU in two processes (this one the decode, a child the prefill), moved by NIXL (UCX
``cuda_ipc``/``cuda_copy``, VRAM registered where ``pools.placement`` finds it), every moved byte
compared on the GPU, and the digests made on the GPU (``digest_form`` ``device``) at ``sampled`` and
``full``. Skipped without CUDA or NIXL; ``make test-gpu`` runs it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdstate.agent import DecodeAgent, RequestState
from pdstate.pools.placement import memory_devices
from tests.agent.support import AUX_SLOTS, PrefillProcess, buffers, channels, device_view, fill, make_side
from tests.support.engines import ENGINE_OPTIONS, require_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.nixl,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu on a host with one)"),
]

DEVICE = "cuda:0"
PREFILL_SEED, DECODE_SEED = 11, 99
SRC_PAGES, DST_PAGES = [1, 2, 3, 4, 5, 6, 7, 8], [9, 3, 4, 10, 11, 12, 1, 2]
SRC_STATE, DST_STATE = [[1, 2], [3], [1, 2]], [[2, 3], [7], [2, 3]]


@pytest.fixture(scope="module")
def decode_side():
    require_engine("nixl")
    side = make_side(False, device=DEVICE)
    yield side
    side.close()


@pytest.mark.parametrize("level", ["sampled", "full"])
def test_gpu_pools_move_byte_exact_with_device_digests(decode_side, level):
    kv = decode_side.kv_args
    assert set(memory_devices([p for p, _, _ in buffers(kv)])) == {DEVICE}
    fill(kv, DECODE_SEED, DEVICE)
    pf = PrefillProcess(PREFILL_SEED, engine="nixl", engine_options=ENGINE_OPTIONS["nixl"], device=DEVICE)
    pools = (decode_side.pools.target, decode_side.pools.draft)
    agent = DecodeAgent(kv, pools, engine="nixl", engine_options=ENGINE_OPTIONS["nixl"], verify=level)
    try:
        room = 7 if level == "sampled" else 8
        recv = agent.receiver(pf.address, room)
        assert pf.ask(op="sender", room=room, num_pages=len(SRC_PAGES), aux_index=3)["state"] == "bootstrapping"
        recv.init(DST_PAGES, DST_STATE, aux_index=AUX_SLOTS - 1)
        assert "raised" not in pf.ask(op="send", room=room, pages=SRC_PAGES, state=SRC_STATE)
        assert recv.wait(60) is RequestState.SUCCESS, recv.failure_exception()
        done = pf.ask(op="wait", room=room, timeout=60)
        assert done["state"] == "success", done
        assert done["metrics"]["verify"] == recv.metrics["verify"] == level
        assert done["metrics"]["digest_form"] == "device"
        # every moved item equals the prefill's (its bytes regenerated here from its seed)
        bufs = buffers(kv)
        moves = [(0, SRC_PAGES, DST_PAGES), *((c + 1, s, d) for c, (s, d) in enumerate(zip(SRC_STATE, DST_STATE)))]
        moves.append((len(kv.state_types) + 1, [3], [AUX_SLOTS - 1]))
        for ch, si, di in moves:
            for j in channels(kv)[ch]:
                ptr, n, item = bufs[j]
                src = np.random.default_rng([PREFILL_SEED, j]).integers(0, 256, n, dtype=np.uint8)
                got = device_view(ptr, n, DEVICE)
                for s, d in zip(si, di):
                    want = torch.from_numpy(src[s * item : (s + 1) * item]).to(DEVICE)
                    assert torch.equal(got[d * item : (d + 1) * item], want), f"buffer {j}: item {d}"
    finally:
        agent.close()
        pf.close()
