"""``[migration]``: the migration listener's bind and advertised address, and the listeners a
target may dial (``migration.sources``): validated at load, each error naming the key."""

from __future__ import annotations

import pytest

from pdstate.errors import ConfigError
from pdstate.settings.config import load_config
from pdstate.worker.options import WorkerOptions


def _load(*overrides: str):
    return load_config(None, ["role=decode", *overrides], environ={})


def test_defaults_bind_loopback_port_0_and_advertise_the_bound_address():
    m = _load().migration
    assert (m.bind, m.advertise, m.sources) == ("tcp://127.0.0.1:0", "", [])
    cfg = _load(
        "migration.bind=tcp://127.0.0.2:7001",
        "migration.advertise=tcp://decode-a.example:7001",
        'migration.sources=["tcp://10.0.0.5:7001", "tcp://[fd00::5]:7001"]',
    )
    o = WorkerOptions.from_config(cfg)
    assert (o.migration_bind, o.migration_advertise) == ("tcp://127.0.0.2:7001", "tcp://decode-a.example:7001")
    assert cfg.migration.sources == ["tcp://10.0.0.5:7001", "tcp://[fd00::5]:7001"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "migration.bind=127.0.0.1:0",
            "migration.bind: Value error, '127.0.0.1:0' is not tcp://host:port (a port 0-65535)",
        ),
        (
            "migration.bind=tcp://127.0.0.1:65536",
            "migration.bind: Value error, 'tcp://127.0.0.1:65536' is not tcp://host:port (a port 0-65535)",
        ),
        (
            "migration.advertise=tcp://10.0.0.5:0",
            "migration.advertise: Value error, 'tcp://10.0.0.5:0' cannot be dialled; name the host and port "
            "a target reaches this decode's migration listener at",
        ),
        (
            'migration.sources=["tcp://10.0.0.*:7001"]',
            "migration.sources: Value error, 'tcp://10.0.0.*:7001' is a pattern; list each migrating "
            "decode's listener by its exact address (its migration.advertise, tcp://host:port)",
        ),
        (
            'migration.sources=["tcp://0.0.0.0:7001"]',
            "migration.sources: Value error, 'tcp://0.0.0.0:7001' is not one listener's address",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError) as exc:
        _load(override)
    assert str(exc.value) == f"invalid configuration: {message} (from --set {override})"


def test_a_wildcard_bind_needs_an_advertised_address_and_a_token():
    with pytest.raises(ConfigError, match=r"'tcp://\*:0' binds every interface; set migration.advertise"):
        _load("migration.bind=tcp://*:0")
    with pytest.raises(ConfigError) as exc:
        _load("migration.bind=tcp://0.0.0.0:7001", "migration.advertise=tcp://10.0.0.5:7001")
    assert str(exc.value).startswith(
        "migration.bind: 'tcp://0.0.0.0:7001' is reachable beyond loopback but no auth token is configured"
    )
    token = "auth.token=3f9a1c7e5b2d48e6a0c4f1b9d7e3a5c2"  # random hex, 32 bytes
    cfg = _load("migration.bind=tcp://0.0.0.0:7001", "migration.advertise=tcp://10.0.0.5:7001", token)
    assert cfg.migration.advertise == "tcp://10.0.0.5:7001"
