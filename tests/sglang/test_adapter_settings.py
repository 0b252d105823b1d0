"""The adapter's configuration and pool lookup, without SGLang (pdstate's own pools stand in)."""

from __future__ import annotations

import pytest

from pdstate.errors import ConfigError
from pdstate.integrations.sglang.settings import CONFIG_ENV, find_pools, layout_report, load_settings
from pdstate.pools.kvargs import fill_kv_args
from pdstate.pools.presets import build_worker_pools, preset
from pdstate.pools.reporting import build_report


def test_the_default_engine_is_mooncake_and_foreign_pdstate_variables_are_not_configuration():
    s = load_settings("prefill", environ={"PDSTATE_SGLANG_ENV": "/somewhere", "PDSTATE_SHARED": "x"})
    assert s.engine == "mooncake"
    assert s.engine_options == {"host": "127.0.0.1", "protocol": "tcp", "device_name": ""}
    assert s.token is None


def test_environment_and_file_choose_the_engine(tmp_path):
    path = tmp_path / "pdstate.toml"
    path.write_text('[transfer]\nengine = "nixl"\n[control]\npeer_timeout_s = 7.5\n')
    s = load_settings("decode", environ={CONFIG_ENV: str(path)})
    assert (s.engine, s.peer_timeout_s) == ("nixl", 7.5)
    s = load_settings("decode", environ={CONFIG_ENV: str(path), "PDSTATE_TRANSFER__ENGINE": "loopback"})
    assert s.engine == "loopback"


def test_shm_and_bad_keys_are_refused_with_one_line():
    with pytest.raises(ConfigError, match="'shm' needs the decode's buffers in /dev/shm"):
        load_settings("decode", environ={"PDSTATE_TRANSFER__ENGINE": "shm"})
    with pytest.raises(ConfigError, match=r"transfer\.engine: .*\(from environment PDSTATE_TRANSFER__ENGINE\)"):
        load_settings("decode", environ={"PDSTATE_TRANSFER__ENGINE": "carrier-pigeon"})


def test_the_pool_pair_behind_a_kvargs_is_found_among_other_pools():
    mine, other = build_worker_pools(preset("tiny")), build_worker_pools(preset("tiny"))
    kv = fill_kv_args(mine.target, mine.draft)
    candidates = [other.draft, other.target, mine.draft, mine.target]
    target, draft = find_pools(kv, candidates)
    assert target is mine.target and draft is mine.draft
    assert layout_report(kv, candidates) == build_report(mine.target, mine.draft)[0]
    alone = fill_kv_args(mine.target, None)
    assert find_pools(alone, candidates) == (mine.target, None)


def test_a_kvargs_no_live_pool_owns_is_refused():
    kv = fill_kv_args(*(lambda p: (p.target, p.draft))(build_worker_pools(preset("tiny"))))
    kv.kv_data_ptrs = [p + 64 for p in kv.kv_data_ptrs]
    with pytest.raises(TypeError, match="moves DeepSeek-V4 state only: no DeepSeekV4TokenToKVPool pair"):
        find_pools(kv, [])


def test_each_decode_rank_fed_by_one_prefill_rank_asks_under_a_room_of_its_own():
    """A decode attention TP ``N`` times the prefill's: ranks ``k*N .. k*N+N-1`` take prefill rank
    ``k`` (SGLang's mapping), each under its own room in the protocol's 63-bit range; a decode of
    one rank per prefill rank keeps SGLang's room."""
    from types import SimpleNamespace

    from pdstate.integrations.sglang.replicas import asked_rooms, replica_index, replica_room

    assert [replica_index(rank, 4, 2) for rank in range(4)] == [0, 1, 0, 1]
    assert [replica_index(rank, 2, 1) for rank in range(2)] == [0, 0]
    big = (1 << 63) - 1
    for room in (0, 7, 5006, big):
        assert replica_room(room, 0, 1) == room
        rooms = [replica_room(room, i, n) for n in (2, 3, 4) for i in range(n)]
        assert len(set(rooms) | {room}) == len(rooms) + 1
        assert all(0 <= r <= big for r in rooms)
    with pytest.raises(ValueError):
        replica_room(1, 2, 2)
    asked: set[int] = set()
    agent = SimpleNamespace(requested=asked.__contains__)
    assert asked_rooms(agent, 5006) is None
    asked.add(replica_room(5006, 0, 2))
    assert asked_rooms(agent, 5006) is None  # the prefill waits for every decode rank
    asked.add(replica_room(5006, 1, 2))
    assert asked_rooms(agent, 5006) == [replica_room(5006, 0, 2), replica_room(5006, 1, 2)]
    assert asked_rooms(SimpleNamespace(requested={5006}.__contains__), 5006) == [5006]
