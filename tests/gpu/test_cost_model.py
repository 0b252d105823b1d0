"""The cost model's projection (``devtools.cost_model.H200_RDMA``) checked on the first GPU host: its
per-byte parts against what this device measures.

- Device digest: ``agent.verify.lane_values`` over 1 GiB of items on the device. The projection
  takes 3 passes over the bytes at the bandwidth the memory reaches in practice (80% of its peak);
  here that bandwidth is measured (a device-to-device copy: each byte read and written, 2
  passes), so the expected throughput is ``copy bandwidth * 2 / 3``, and the measured one must be
  within ``FACTOR`` of it either way. Where the device is an H200, the copy's 2 passes are also
  checked against the 4.8 TB/s the projection assumes, within ``FACTOR``.
- Transfer: the projection's per-byte part is the link's (48.3 GB/s effective), which assumes
  the device's memory is not what bounds a request's bytes: a device-to-device copy of the same
  1 GiB must run at least at the link's rate.

Medians of ``RUNS`` timed runs after a warm-up, timed with CUDA events. Skipped without CUDA.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from pdstate.agent.verify import lane_values
from pdstate.devtools.cost_model import H200_RDMA

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu on a host with one)"),
]

DEVICE = "cuda:0"
NBYTES = 1 << 30
ITEM = 64 * 1024  # bytes an item (a state row or a page's slice: tens of KB in dsv4-flash)
RUNS = 5
FACTOR = 3.0  # measured within this factor of the projection's figure, either way
HBM_H200 = 4.8e12  # the projection's memory bandwidth (NVIDIA's H200 specification)


def _seconds(fn) -> float:
    fn()  # warm-up
    torch.cuda.synchronize()
    out = []
    for _ in range(RUNS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return statistics.median(out)


@pytest.fixture(scope="module")
def buffers():
    src = torch.randint(0, 256, (NBYTES // ITEM, ITEM), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    yield src, dst
    del src, dst
    torch.cuda.empty_cache()


def test_device_digest_throughput_is_within_the_factor_of_the_projection(buffers):
    src, dst = buffers
    copy_bytes_s = NBYTES / _seconds(lambda: dst.copy_(src))
    digest_bytes_s = NBYTES / _seconds(lambda: lane_values(src))
    expected = copy_bytes_s * 2 / 3  # the projection's rule, on the bandwidth this device's copy reaches
    name = torch.cuda.get_device_name(0)
    report = (
        f"{name}: copy {copy_bytes_s / 1e12:.2f} TB/s, digest {digest_bytes_s / 1e12:.2f} TB/s, "
        f"expected {expected / 1e12:.2f} TB/s (the projection's H200 figure: "
        f"{H200_RDMA.device_digest_bytes_s / 1e12:.2f} TB/s)"
    )
    print(report)
    assert expected / FACTOR <= digest_bytes_s <= expected * FACTOR, report
    if "H200" in name:
        assert HBM_H200 / FACTOR <= copy_bytes_s * 2 <= HBM_H200 * FACTOR, report


def test_a_device_transfer_is_not_what_bounds_the_link(buffers):
    src, dst = buffers
    copy_bytes_s = NBYTES / _seconds(lambda: dst.copy_(src))
    assert torch.equal(dst[:, :64], src[:, :64])
    assert copy_bytes_s >= H200_RDMA.link_bytes_s, (
        f"a device copy moved {copy_bytes_s / 1e9:.1f} GB/s, below the link's "
        f"{H200_RDMA.link_bytes_s / 1e9:.1f} GB/s: the device, not the link, would bound the per-byte part"
    )
