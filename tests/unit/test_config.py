"""Worker configuration: TOML file < PDSTATE_* environment < --set; strict errors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdstate.errors import ConfigError
from pdstate.settings.config import load_config
from pdstate.worker.options import WorkerOptions
from tests.support.paths import REPO


@pytest.fixture
def toml(tmp_path):
    def write(text: str) -> Path:
        p = tmp_path / "worker.toml"
        p.write_text(text)
        return p

    return write


BASE = """
role = "decode"
preset = "tiny"
[http]
port = 9000
[control]
peer = "tcp://10.0.0.1:5601"
peer_timeout_s = 7.5
"""


def test_file_values(toml):
    cfg = load_config(toml(BASE), environ={})
    assert cfg.role == "decode" and cfg.http.port == 9000 and cfg.http.host == "127.0.0.1"
    assert cfg.control.peer == "tcp://10.0.0.1:5601" and cfg.control.peer_timeout_s == 7.5
    assert cfg.transfer.engine == "shm" and cfg.checks.local is True and cfg.draft.mapping == "shared"


def test_environment_overrides_file_and_set_overrides_environment(toml):
    path = toml(BASE)
    env = {"PDSTATE_HTTP__PORT": "9100", "PDSTATE_CONTROL__PEER_TIMEOUT_S": "2", "PDSTATE_DRAFT__MAPPING": "own"}
    cfg = load_config(path, environ=env)
    assert cfg.http.port == 9100 and cfg.control.peer_timeout_s == 2.0 and cfg.draft.mapping == "own"
    cfg = load_config(path, ["http.port=9200", "draft.mapping=shared"], environ=env)
    assert cfg.http.port == 9200 and cfg.draft.mapping == "shared"
    assert cfg.control.peer_timeout_s == 2.0  # untouched by --set: the environment still wins over the file


def test_values_parse_as_toml_scalars(toml):
    cfg = load_config(
        toml(BASE),
        [
            "checks.local=false",
            "pool.unified_kv=true",
            'transfer.engine="mooncake"',
            "transfer.mooncake.protocol=rdma",
            "worker_id=decode-7",
        ],
        environ={},
    )
    assert cfg.checks.local is False and cfg.pool.unified_kv is True
    assert cfg.transfer.engine == "mooncake" and cfg.transfer.mooncake.protocol == "rdma"
    assert cfg.worker_id == "decode-7"


def test_nested_environment_key(toml):
    cfg = load_config(
        toml(BASE),
        environ={"PDSTATE_TRANSFER__MOONCAKE__HOST": "10.1.2.3", "PDSTATE_AUTH__TOKEN": "t0k3n-of-sixteen-bytes"},
    )
    assert cfg.transfer.mooncake.host == "10.1.2.3"
    assert cfg.auth.secret() == b"t0k3n-of-sixteen-bytes"


def test_mooncake_options_reach_the_engine_constructor(toml):
    import inspect

    from pdstate.transfer.engines.mooncake import MooncakeEngine

    cfg = load_config(toml(BASE), ["transfer.engine=mooncake", "transfer.mooncake.device=mlx5_0"], environ={})
    opts = WorkerOptions.from_config(cfg).engine_options
    assert opts == {"host": "127.0.0.1", "protocol": "tcp", "device_name": "mlx5_0"}
    assert set(opts) <= set(inspect.signature(MooncakeEngine.__init__).parameters)


def test_token_file(toml, tmp_path):
    secret = tmp_path / "token"
    secret.write_text("from-file-0123456789\n")
    secret.chmod(0o600)  # this user's alone (tests/security/test_fail_closed.py)
    cfg = load_config(toml(BASE), [f'auth.token_file="{secret}"'], environ={})
    assert cfg.auth.secret() == b"from-file-0123456789"
    assert load_config(toml(BASE), environ={}).auth.secret() is None
    # fails closed at load time (tests/security/test_fail_closed.py has every case)
    with pytest.raises(ConfigError, match=r"^auth\.token_file: cannot read .*absent: No such file or directory; "):
        load_config(toml(BASE), [f'auth.token_file="{tmp_path / "absent"}"'], environ={})


def test_unknown_key_is_named(toml):
    with pytest.raises(ConfigError, match=r"pool\.bogus: Extra inputs are not permitted \(from --set pool\.bogus=1\)"):
        load_config(toml(BASE), ["pool.bogus=1"], environ={})
    with pytest.raises(ConfigError, match=r"http\.colour: Extra inputs are not permitted \(in "):
        load_config(toml(BASE.replace("port = 9000", "port = 9000\ncolour = 1")), environ={})
    with pytest.raises(
        ConfigError,
        match=r"http\.portt: Extra inputs are not permitted \(from environment PDSTATE_HTTP__PORTT\); "
        r"did you mean PDSTATE_HTTP__PORT\?",
    ):
        load_config(toml(BASE), environ={"PDSTATE_HTTP__PORTT": "1"})


def test_wrong_type_is_named(toml):
    with pytest.raises(ConfigError, match=r"http\.port: .*valid integer.*\(from environment PDSTATE_HTTP__PORT\)"):
        load_config(toml(BASE), environ={"PDSTATE_HTTP__PORT": "eighty"})
    with pytest.raises(ConfigError, match=r"http\.port: Input should be less than 65536"):
        load_config(toml(BASE), ["http.port=70000"], environ={})
    with pytest.raises(ConfigError, match=r"draft\.mapping: Input should be 'shared', 'own' or 'clone'"):
        load_config(toml(BASE), ["draft.mapping=borrowed"], environ={})
    with pytest.raises(ConfigError, match=r"transfer\.engine: Input should be"):
        load_config(toml(BASE), ["transfer.engine=carrier-pigeon"], environ={})
    with pytest.raises(ConfigError, match=r"role: Input should be 'prefill' or 'decode'"):
        load_config(toml(BASE), ["role=router"], environ={})


def test_bad_preset_is_named(toml):
    with pytest.raises(
        ConfigError,
        match=r"^preset: unknown preset 'huge'; choose one of \['dsv4-flash', 'tiny'\] \(from --set preset=huge\)$",
    ):
        load_config(toml(BASE), ["preset=huge"], environ={})


def test_missing_role_file_errors_and_bad_set_syntax(toml, tmp_path):
    with pytest.raises(ConfigError, match=r"^invalid configuration: role: Field required"):
        load_config(None, environ={})
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "absent.toml", environ={})
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(toml("role = "), environ={})
    with pytest.raises(ConfigError, match=r"expected section\.key=value"):
        load_config(toml(BASE), ["http.port"], environ={})
    with pytest.raises(ConfigError, match=r"http\.port: http is not a section|port: http\.port"):
        load_config(toml(BASE), ["http=1", "http.port=2"], environ={})


def test_pdstate_shared_is_not_a_key(toml, caplog):
    assert load_config(toml(BASE), environ={"PDSTATE_SHARED": "/somewhere"}).role == "decode"
    assert not caplog.records


@pytest.fixture
def fresh_warnings(monkeypatch):
    from pdstate.settings import config

    monkeypatch.setattr(config, "_WARNED", set())


@pytest.mark.parametrize(
    ("name", "nearest"),
    [
        ("PDSTATE_ENGINE", "PDSTATE_TRANSFER__ENGINE"),
        ("PDSTATE_AUTH_TOKEN", "PDSTATE_AUTH__TOKEN"),
        ("PDSTATE_TRANSFR__ENGINE", "PDSTATE_TRANSFER__ENGINE"),
        ("PDSTATE_CONTROL_PEER_TIMEOUT_S", "PDSTATE_CONTROL__PEER_TIMEOUT_S"),
    ],
)
def test_other_pdstate_names_warn_once_with_the_nearest_key(toml, caplog, fresh_warnings, name, nearest):
    for _ in range(2):  # serve loads once, check once per file: one warning per process
        cfg = load_config(toml(BASE), environ={name: "mooncake"})
    assert cfg.transfer.engine == "shm" and cfg.auth.secret() is None  # ignored, not applied
    [record] = caplog.records
    assert record.levelname == "WARNING" and record.name == "pdstate.config"
    assert f"environment {name} is not a configuration name" in record.getMessage()
    assert f"did you mean {nearest}?" in record.getMessage()


def test_a_name_near_nothing_and_the_backend_variable_warn_too(toml, caplog, fresh_warnings):
    load_config(toml(BASE), environ={"PDSTATE_NOSUCH": "1", "PDSTATE_SGLANG_CONFIG": "/x.toml"})
    texts = [r.getMessage() for r in caplog.records]
    assert len(texts) == 2
    assert "PDSTATE_NOSUCH is not a configuration name" in texts[0] and "PDSTATE_SECTION__KEY" in texts[0]
    assert "PDSTATE_SGLANG_CONFIG is not configuration here: read by the SGLang backend only" in texts[1]
    caplog.clear()
    load_config(toml(BASE), environ={"PDSTATE_SGLANG_CONFIG": "/x.toml"}, known=("PDSTATE_SGLANG_CONFIG",))
    assert not caplog.records


def test_every_environment_name_is_a_key():
    from pdstate.settings.config import environment_names

    names = environment_names()
    assert {"PDSTATE_ROLE", "PDSTATE_HTTP__PORT", "PDSTATE_TRANSFER__MOONCAKE__HOST"} <= set(names)
    assert all(name == name.upper() and name.startswith("PDSTATE_") for name in names)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_service_configs_load_as_shipped(role):
    cfg = load_config(REPO / "services" / role / "config.toml", environ={})
    assert cfg.role == role and cfg.preset == "tiny" and cfg.transfer.engine == "shm"
    assert cfg.http.host == "127.0.0.1" and cfg.http.port == {"prefill": 8101, "decode": 8102}[role]
    opts = WorkerOptions.from_config(cfg)
    assert opts.role == role and opts.local_checks is True and opts.token is None
    if role == "prefill":
        assert cfg.control.bind == "tcp://127.0.0.1:5601"
    else:
        assert cfg.control.peer == "tcp://127.0.0.1:5601"


def test_service_configs_pair():
    p = load_config(REPO / "services" / "prefill" / "config.toml", environ={})
    d = load_config(REPO / "services" / "decode" / "config.toml", environ={})
    assert p.control.bind == d.control.peer
    assert p.pool_settings() == d.pool_settings() and p.transfer.engine == d.transfer.engine


def test_verify_mode_and_inline_limit_reach_the_worker_options(toml):
    opts = WorkerOptions.from_config(
        load_config(toml(BASE), ["checks.verify=sample", "control.inline_max_bytes=0"], environ={})
    )
    assert opts.verify == "sample" and opts.inline_max_bytes == 0
    defaults = WorkerOptions.from_config(load_config(toml(BASE), environ={}))
    assert defaults.verify == "full" and defaults.inline_max_bytes == 32 << 20
    with pytest.raises(ConfigError, match="checks.verify"):
        load_config(toml(BASE), ["checks.verify=some"], environ={})


def test_the_dead_prefill_horizon_reaches_the_worker_options(toml):
    opts = WorkerOptions.from_config(load_config(toml(BASE), ["control.dead_prefill_release_s=45"], environ={}))
    assert opts.dead_prefill_release_s == 45.0
    assert WorkerOptions.from_config(load_config(toml(BASE), environ={})).dead_prefill_release_s == 300.0
    with pytest.raises(ConfigError, match="control.dead_prefill_release_s"):
        load_config(toml(BASE), ["control.dead_prefill_release_s=0"], environ={})
    from pdstate.integrations.sglang.settings import load_settings  # SGLang's decode ranks: the same key

    assert (
        load_settings("decode", environ={"PDSTATE_CONTROL__DEAD_PREFILL_RELEASE_S": "45"}).dead_prefill_release_s == 45
    )


def test_pool_upstream_defaults_to_the_newest_release(toml):
    cfg = load_config(toml(BASE), environ={})
    assert cfg.pool.upstream is None and cfg.pool_settings().upstream == "0.5.23"


@pytest.mark.parametrize("release", ["0.5.19", "0.5.23"])
def test_pool_upstream_from_file_environment_and_set(toml, release):
    cfg = load_config(toml(BASE + f'[pool]\nupstream = "{release}"\n'), environ={})
    assert cfg.pool_settings().upstream == release
    cfg = load_config(toml(BASE), environ={"PDSTATE_POOL__UPSTREAM": release})
    assert cfg.pool_settings().upstream == release
    cfg = load_config(toml(BASE), [f"pool.upstream={release}"], environ={})
    assert cfg.pool_settings().upstream == release
    from pdstate.pools.presets import pool_kwargs

    assert pool_kwargs(cfg.pool_settings())["upstream"] == release


@pytest.mark.parametrize("value", ['"0.5.20"', '"latest"', "0.5", "5"])
def test_pool_upstream_other_value_is_named(toml, value):
    with pytest.raises(ConfigError) as info:
        load_config(toml(BASE + f"[pool]\nupstream = {value}\n"), environ={})
    msg = str(info.value)
    assert msg.startswith("invalid configuration: pool.upstream: ")
    assert "unknown SGLang release" in msg and "choose one of '0.5.19', '0.5.23'" in msg


def test_the_sglang_backend_warns_alike_and_reads_its_own_variable(tmp_path, caplog, fresh_warnings):
    from pdstate.integrations.sglang.settings import CONFIG_ENV, load_settings

    path = tmp_path / "pdstate.toml"
    path.write_text("[control]\npeer_timeout_s = 7.5\n")
    s = load_settings("decode", environ={CONFIG_ENV: str(path), "PDSTATE_TRANSFR__ENGINE": "nixl"})
    assert (s.engine, s.peer_timeout_s) == ("mooncake", 7.5)  # the misspelled section is not applied...
    [record] = caplog.records  # ...and says so, while the backend's own variable is read without a word
    assert "PDSTATE_TRANSFR__ENGINE" in record.getMessage()
    assert "did you mean PDSTATE_TRANSFER__ENGINE?" in record.getMessage()


def test_control_prefills_are_exact_addresses():
    """``control.prefills`` names prefills by exact address: a pattern is refused, one line (it
    was an fnmatch pattern); a bracketed IPv6 host is an address."""
    entry = "tcp://10.0.0.*:5601"
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["role=decode", f'control.prefills=["tcp://10.0.0.2:5601", "{entry}"]'])
    assert str(exc.value) == (
        f"invalid configuration: control.prefills: Value error, {entry!r} is a pattern; list each prefill a "
        "transfer may name by its exact control address (tcp://host:port): a decode dials only addresses named "
        f'exactly (from --set control.prefills=["tcp://10.0.0.2:5601", "{entry}"])'
    )
    for pattern in ("tcp://10.0.0.2:560?", "tcp://[::1]:56[01]", "tcp://prefill-[ab]:5601"):
        with pytest.raises(ConfigError, match=r"is a pattern"):
            load_config(None, ["role=decode", f'control.prefills=["{pattern}"]'])
    cfg = load_config(None, ["role=decode", 'control.prefills=["tcp://[::1]:5601", "tcp://prefill-b:5601"]'])
    assert cfg.control.prefills == ["tcp://[::1]:5601", "tcp://prefill-b:5601"]


def test_a_peer_timeout_within_two_heartbeats_is_refused():
    """A timeout under two heartbeat intervals would declare a live peer gone on one late
    heartbeat: refused, one line naming both keys; exactly two intervals is taken."""
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["role=decode", "control.peer_timeout_s=1"])
    text = str(exc.value)
    assert text.startswith(
        "invalid configuration: control: Value error, control.peer_timeout_s (1) is under twice "
        "control.heartbeat_interval_s (1): a live peer would be declared gone on its first late heartbeat"
    ), text
    assert "\n" not in text
    cfg = load_config(None, ["role=decode", "control.peer_timeout_s=1", "control.heartbeat_interval_s=0.5"])
    assert (cfg.control.peer_timeout_s, cfg.control.heartbeat_interval_s) == (1.0, 0.5)
