"""shm engine specifics: what a decode may register, what connect refuses, /proc maps parsing."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from pdstate.pools.memory import SEGMENT_HEADER_BYTES, BufferSpec, PrivateMemory, Region, SharedMemory
from pdstate.transfer.engines import EngineError, InvalidEndpoint
from pdstate.transfer.engines.shm import ShmEngine, _Mapping, shared_file_of
from pdstate.transfer.plan import TransferPlan
from tests.support.engines import proven
from tests.support.images import SENTINEL

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def engines() -> Iterator:
    made: list[ShmEngine] = []

    def make() -> ShmEngine:
        made.append(ShmEngine())
        made[-1].start()
        return made[-1]

    yield make
    for e in made:
        e.close()


@pytest.fixture
def shm() -> Iterator[SharedMemory]:
    with SharedMemory() as memory:
        yield memory


def test_decode_with_private_memory_is_refused_at_endpoint(engines) -> None:
    memory = PrivateMemory()
    memory.allocate("dst", [BufferSpec("b", (1 << 20,), torch.uint8)])
    decode = engines()
    decode.register(memory.regions())
    with pytest.raises(EngineError, match=r"is not in a shared file mapping; decode regions must be SharedMemory"):
        decode.endpoint()


def test_a_region_inside_a_segment_publishes_its_file_offset_and_receives(engines, shm) -> None:
    (arena,) = shm.allocate("dst", [BufferSpec("b", (64 << 10,), torch.uint8)])
    arena.fill_(SENTINEL)
    seg = shm.segments[0]
    inner = Region("inner", seg.base_ptr + 8192, 4096)
    decode = engines()
    decode.register([inner])
    (published,) = decode.endpoint()["regions"]
    assert published == {
        "name": "inner",
        "base_ptr": inner.base_ptr,
        "nbytes": 4096,
        "path": seg.path,
        "file_offset": SEGMENT_HEADER_BYTES + 8192,  # the buffers follow the segment's header
    }

    src = torch.arange(4096, dtype=torch.int64).remainder(253).to(torch.uint8)
    prefill = engines()
    prefill.register([Region("src", src.data_ptr(), 4096)])
    peer = prefill.connect(proven(prefill, decode.endpoint()))
    plan = TransferPlan.from_arrays([src.data_ptr() + 10], [inner.base_ptr + 4000], [96])
    prefill.wait(prefill.submit(peer, plan), 1.0)
    want = np.full(64 << 10, SENTINEL, dtype=np.uint8)
    want[8192 + 4000 : 8192 + 4096] = src.numpy()[10:106]
    assert np.array_equal(arena.numpy(), want)


def test_connect_refuses_another_kernel(engines, shm) -> None:
    shm.allocate("dst", [BufferSpec("b", (4096,), torch.uint8)])
    decode = engines()
    decode.register(shm.regions())
    with pytest.raises(InvalidEndpoint, match="runs under another kernel"):
        prefill = engines()
        prefill.connect(proven(prefill, {**decode.endpoint(), "boot_id": "00000000-other-host"}))


def test_connect_to_an_unlinked_segment_fails(engines, shm) -> None:
    shm.allocate("dst", [BufferSpec("b", (4096,), torch.uint8)])
    decode = engines()
    decode.register(shm.regions())
    endpoint = decode.endpoint()
    os.unlink(shm.segments[0].path)
    prefill = engines()
    with pytest.raises(EngineError, match="cannot map segment"):
        prefill.connect(proven(prefill, endpoint))


def test_connect_refuses_a_region_longer_than_its_file(engines, shm) -> None:
    shm.allocate("dst", [BufferSpec("b", (4096,), torch.uint8)])
    decode = engines()
    decode.register(shm.regions())
    endpoint = decode.endpoint()
    endpoint["regions"][0]["file_offset"] = 8192
    prefill = engines()
    with pytest.raises(EngineError, match="needs 12288 bytes of"):
        prefill.connect(proven(prefill, endpoint))


def _maps(*rows: tuple[int, int, bool, int, str]) -> list[_Mapping]:
    return [_Mapping(*r) for r in rows]


def test_shared_file_of_follows_split_mappings() -> None:
    maps = _maps((0x1000, 0x3000, True, 0, "/dev/shm/a"), (0x3000, 0x5000, True, 0x2000, "/dev/shm/a"))
    assert shared_file_of(0x2000, 0x2800, maps) == ("/dev/shm/a", 0x1000)


@pytest.mark.parametrize(
    "maps,match",
    [
        (_maps((0x1000, 0x3000, True, 0, "/dev/shm/a")), "runs past the shared mapping"),
        (
            _maps((0x1000, 0x3000, True, 0, "/dev/shm/a"), (0x3000, 0x5000, True, 0x9000, "/dev/shm/a")),
            "runs past the shared mapping",
        ),
        (_maps((0x1000, 0x5000, False, 0, "/usr/lib/x.so")), "not in a shared file mapping"),
        (_maps((0x1000, 0x5000, True, 0, "/dev/shm/a (deleted)")), "was unlinked"),
        (_maps(), "not in a shared file mapping"),
    ],
    ids=["too-short", "offset-gap", "private", "deleted", "unmapped"],
)
def test_shared_file_of_refuses(maps, match) -> None:
    with pytest.raises(EngineError, match=match):
        shared_file_of(0x2000, 0x2800, maps)


def _forged_endpoint(engine_id: str, path: str, nbytes: int) -> dict:
    return {
        "engine": "shm",
        "engine_id": engine_id,
        "boot_id": "",
        "owner_pid": os.getpid(),
        "regions": [{"name": "r", "base_ptr": 1 << 40, "nbytes": nbytes, "path": path, "file_offset": 0}],
    }


def test_connect_refuses_to_map_a_file_outside_the_segment_directory(engines, tmp_path) -> None:
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"\x00" * 4096)
    prefill = engines()
    with pytest.raises(InvalidEndpoint, match=r"only pdstate-\* segments in /dev/shm are mapped"):
        prefill.connect(proven(prefill, _forged_endpoint("forged1", str(victim), 4096)))
    assert victim.read_bytes() == b"\x00" * 4096


def test_connect_refuses_symlinks_and_shared_permission_segments(engines) -> None:
    target = f"/dev/shm/pdstate-{os.getpid()}-deadbeef-target"
    link = f"/dev/shm/pdstate-{os.getpid()}-deadbeef-link"
    loose = f"/dev/shm/pdstate-{os.getpid()}-deadbeef-loose"
    try:
        with open(target, "wb") as f:
            f.write(b"\x00" * 4096)
        os.chmod(target, 0o600)
        os.symlink(target, link)
        with open(loose, "wb") as f:
            f.write(b"\x00" * 4096)
        os.chmod(loose, 0o666)
        prefill = engines()
        with pytest.raises(EngineError):
            prefill.connect(proven(prefill, _forged_endpoint("forged2", link, 4096)))
        with pytest.raises(InvalidEndpoint, match=r"is not a private regular file of this user \(uid \d+, mode 666\)"):
            prefill.connect(proven(prefill, _forged_endpoint("forged3", loose, 4096)))
    finally:
        for p in (link, target, loose):
            if os.path.lexists(p):
                os.unlink(p)


def test_connect_maps_nothing_until_every_segment_is_proven(engines, shm) -> None:
    shm.allocate("dst", [BufferSpec("b", (4096,), torch.uint8)])
    decode = engines()
    decode.register(shm.regions())
    endpoint, path = decode.endpoint(), shm.segments[0].path
    prefill = engines()
    with pytest.raises(InvalidEndpoint, match=r"^shm endpoint of w/1 carries no proof of ownership of its segments"):
        prefill.connect(endpoint, owner="w/1")
    nonce = prefill.challenge("w/1")
    with pytest.raises(InvalidEndpoint) as missing:
        prefill.connect({**endpoint, "challenge": nonce.hex(), "proofs": {}}, owner="w/1")
    assert str(missing.value) == (
        f"shm segment {path} does not belong to the registering decode: its endpoint carries no proof of ownership for it"
    )
    nonce = prefill.challenge("w/1")
    with pytest.raises(InvalidEndpoint, match="its proof of ownership does not match the segment's secret"):
        prefill.connect({**endpoint, **decode.prove(nonce, "w/2")}, owner="w/1")  # proven for someone else
    other = engines()  # another prefill process (e.g. before a restart) issued this nonce
    with pytest.raises(InvalidEndpoint, match="answers a challenge this prefill did not issue to it"):
        prefill.connect({**endpoint, **decode.prove(other.challenge("w/1"), "w/1")}, owner="w/1")
    header = {**endpoint, "regions": [{**endpoint["regions"][0], "file_offset": 0}]}
    with pytest.raises(InvalidEndpoint, match="file_offset 0 is inside the segment's 4096-byte header"):
        prefill.connect({**header, **decode.prove(prefill.challenge("w/1"), "w/1")}, owner="w/1")
    assert prefill.num_peers == 0
    peer = prefill.connect({**endpoint, **decode.prove(prefill.challenge("w/1"), "w/1")}, owner="w/1")
    assert prefill.peer_regions(peer).regions == decode.regions
