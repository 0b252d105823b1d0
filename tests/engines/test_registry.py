"""The engine registry, lifecycle checks and the shared region table."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from pdstate.pools.memory import Region
from pdstate.transfer.engines import (
    ENGINES,
    DescriptorOutOfRange,
    EngineError,
    EngineStateError,
    EngineUnavailable,
    create_engine,
    engine_class,
)
from pdstate.transfer.engines.regions import RegionTable
from pdstate.transfer.engines.shm import ShmEngine


def test_registry_names() -> None:
    assert set(ENGINES) == {"shm", "loopback", "mooncake", "nixl"}


def test_unknown_engine_lists_the_known_ones() -> None:
    with pytest.raises(
        EngineError, match="^unknown transfer engine 'rdma'; known engines: shm, loopback, mooncake, nixl$"
    ):
        create_engine("rdma")


@pytest.mark.parametrize(
    "name,modules",
    [("mooncake", ["mooncake", "mooncake.engine"]), ("nixl", ["nixl_cu12", "nixl_cu12._api"])],
)
def test_missing_native_package_names_the_extra(monkeypatch, name, modules) -> None:
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)  # makes `import m` raise ImportError
    with pytest.raises(EngineUnavailable, match=rf"install it with: pip install 'pdstate\[{name}\]'$") as info:
        engine_class(name)
    assert isinstance(info.value, ImportError)
    assert isinstance(info.value.__cause__, ImportError)


def test_constructor_does_no_io_and_lifecycle_is_checked() -> None:
    engine = create_engine("shm", populate=False)
    assert isinstance(engine, ShmEngine) and engine.populate is False
    with pytest.raises(EngineStateError, match=r"^shm engine: endpoint\(\) called while not started$"):
        engine.endpoint()
    engine.start()
    with pytest.raises(EngineStateError, match="start\\(\\) called twice"):
        engine.start()
    engine.close()


def test_register_refuses_overlap_with_earlier_regions() -> None:
    with create_engine("loopback") as engine:
        engine.register([Region("a", 0x10000, 0x1000)])
        with pytest.raises(EngineError, match="^regions 'a' and 'b' overlap at 0x10800$"):
            engine.register([Region("b", 0x10800, 0x1000)])
        assert engine.regions == [Region("a", 0x10000, 0x1000)]


def test_region_table_rejects_empty_regions() -> None:
    with pytest.raises(EngineError, match="has no bytes to register"):
        RegionTable.build([Region("z", 0x1000, 0)])


def _u(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.uint64)


def test_locate_boundaries() -> None:
    table = RegionTable.build([Region("hi", 0x9000, 0x1000), Region("lo", 0x1000, 0x1000)])
    assert table.names == ("lo", "hi")
    idx = table.locate(_u(0x1000, 0x1FFF, 0x2000, 0x9000), _u(0x1000, 1, 0, 0x1000), "dst")
    assert idx.tolist() == [0, 0, 0, 1]  # a zero-length descriptor may sit at the very end
    for addr, length in [(0x1FFF, 2), (0x0FFF, 1), (0x5000, 1), (0xA000, 1), (0x1000, 2**64 - 1)]:
        with pytest.raises(DescriptorOutOfRange, match=f"^descriptor 1: dst address 0x{addr:x} "):
            table.locate(_u(0x1000, addr), _u(1, length), "dst")


def test_locate_with_no_regions() -> None:
    with pytest.raises(DescriptorOutOfRange, match="^descriptor 0: src address 0x10 "):
        RegionTable().locate(_u(0x10), _u(1), "src")
    assert RegionTable().locate(_u(), _u(), "src").shape == (0,)
