"""A new engine is its module plus one registry entry: a fake engine (the loopback engine under
another name, in this module) registered in ``transfer.engines.registry`` and seen end to end:
configuration accepts it, the open-listener rule reads its trait, and a prefill/decode agent pair
moves a verified request over it (and refuses a peer on another engine, naming both)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, closing, contextmanager

import pytest

from pdstate.agent import DecodeAgent, PrefillAgent, RequestState
from pdstate.errors import ConfigError
from pdstate.settings.auth import check_open_listener
from pdstate.settings.config import load_config
from pdstate.transfer.engines import ENGINES, EngineEntry, create_engine, register_engine, unregister_engine
from pdstate.transfer.engines.loopback import LoopbackEngine
from pdstate.worker.options import WorkerOptions
from tests.agent.support import assert_images_equal, expected, fill, make_side, snapshot

NAME = "carrier"
ROOM = 17
SRC_PAGES, DST_PAGES = [1, 2, 3], [5, 6, 7]
SRC_STATE, DST_STATE = [[1], [0], [1]], [[2], [1], [2]]


class CarrierEngine(LoopbackEngine):
    """The loopback engine under the name ``carrier``, counting the plans it moved."""

    name = NAME
    plans_moved = 0

    def _submit(self, peer, plan, handle, notify) -> None:
        type(self).plans_moved += 1
        super()._submit(peer, plan, handle, notify)


@pytest.fixture
def carrier():
    register_engine(NAME, EngineEntry(__name__, "CarrierEngine", in_process=True))
    CarrierEngine.plans_moved = 0
    yield
    unregister_engine(NAME)


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "decode.toml"
    path.write_text('role = "decode"\n')
    return path


def test_the_registry_refuses_a_name_twice_and_builds_the_new_class(carrier):
    with pytest.raises(ValueError, match=r"^transfer engine 'carrier' is already registered$"):
        register_engine(NAME, EngineEntry(__name__, "CarrierEngine"))
    assert list(ENGINES)[-1] == NAME
    assert type(create_engine(NAME)) is CarrierEngine


def test_configuration_accepts_the_new_engine_and_only_registered_ones(carrier, config_file):
    cfg = load_config(config_file, ["transfer.engine=carrier"], environ={})
    opts = WorkerOptions.from_config(cfg)
    assert (opts.engine, opts.engine_options) == (NAME, {})
    assert cfg.transfer.open_listener_acknowledged() is True  # the entry has no open listener
    with pytest.raises(ConfigError) as info:
        load_config(config_file, ["transfer.engine=pigeon"], environ={})
    assert str(info.value) == (
        "invalid configuration: transfer.engine: Input should be 'shm', 'loopback', 'mooncake', 'nixl' or "
        "'carrier' (from --set transfer.engine=pigeon)"
    )


def test_unregistered_the_name_is_refused_again(config_file):
    with pytest.raises(
        ConfigError, match=r"transfer\.engine: Input should be 'shm', 'loopback', 'mooncake' or 'nixl' "
    ):
        load_config(config_file, ["transfer.engine=carrier"], environ={})


def test_an_open_listener_entry_must_be_acknowledged(config_file):
    register_engine(NAME, EngineEntry(__name__, "CarrierEngine", open_listener=True))
    try:
        cfg = load_config(config_file, ["transfer.engine=carrier"], environ={})
        assert cfg.transfer.open_listener_acknowledged() is False  # no [transfer.carrier] section says so
        with pytest.raises(ConfigError, match=r"^transfer\.carrier\.allow_open_listener: the carrier engine listens"):
            check_open_listener(NAME, cfg.transfer.open_listener_acknowledged())
    finally:
        unregister_engine(NAME)


@contextmanager
def agents(prefill_engine: str, decode_engine: str, verify: str = "sampled") -> Iterator[tuple]:
    """A prefill and a decode agent in this process over filled tiny sides, closed at the end."""
    p, d = make_side(False), make_side(False)
    fill(p.kv_args, 1)
    fill(d.kv_args, 2)
    with ExitStack() as stack:
        for side in (p, d):
            stack.callback(side.close)
        pa = stack.enter_context(
            closing(PrefillAgent(p.kv_args, (p.pools.target, p.pools.draft), engine=prefill_engine))
        )
        da = stack.enter_context(
            closing(DecodeAgent(d.kv_args, (d.pools.target, d.pools.draft), engine=decode_engine, verify=verify))
        )
        yield pa, da, p.kv_args, d.kv_args


@pytest.mark.parametrize("level", ["full", "sampled"])
def test_an_agent_pair_moves_a_verified_request_over_the_new_engine(carrier, level):
    with agents(NAME, NAME, level) as (pa, da, src_kv, dst_kv):
        before, src = snapshot(dst_kv), snapshot(src_kv)
        recv, send = da.receiver(pa.address, ROOM), pa.sender(ROOM, len(SRC_PAGES))
        recv.init(DST_PAGES, DST_STATE)
        send.send(SRC_PAGES, SRC_STATE)
        assert recv.wait(10) is RequestState.SUCCESS, recv.failure_exception()
        assert send.wait(10) is RequestState.SUCCESS, send.failure_exception()
        assert recv.metrics["verify"] == send.metrics["verify"] == level
        assert recv.metrics["bytes"] == send.metrics["bytes"] > 0
        assert CarrierEngine.plans_moved >= 1
        moves = [(0, SRC_PAGES, DST_PAGES)] + [(c + 1, s, t) for c, (s, t) in enumerate(zip(SRC_STATE, DST_STATE))]
        assert_images_equal(snapshot(dst_kv), expected(before, src, dst_kv, moves))


def test_a_decode_on_another_engine_is_refused_naming_both(carrier):
    with agents(NAME, "loopback") as (pa, da, _, _):
        recv = da.receiver(pa.address, ROOM)
        recv.init(DST_PAGES, DST_STATE)
        assert recv.wait(10) is RequestState.FAILED
        assert str(recv.failure_exception()) == (
            "transfer engine mismatch: prefill server uses 'carrier', but decode server uses 'loopback'"
        )
        assert CarrierEngine.plans_moved == 0


def test_every_open_listener_engine_has_a_section_that_can_acknowledge_it(config_file):
    """An entry with ``open_listener`` and no ``allow_open_listener`` to set could never start."""
    open_ones = [n for n, e in ENGINES.items() if e.open_listener]
    assert open_ones == ["mooncake", "nixl"]
    for name in open_ones:
        cfg = load_config(config_file, [f"transfer.engine={name}"], environ={})
        assert cfg.transfer.open_listener_acknowledged() is False
        cfg = load_config(
            config_file, [f"transfer.engine={name}", f"transfer.{name}.allow_open_listener=true"], environ={}
        )
        assert cfg.transfer.open_listener_acknowledged() is True
