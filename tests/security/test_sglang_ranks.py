"""SGLang ranks fail closed, as ``pdstate serve`` does: a rank's agent reachable beyond loopback
(the address SGLang advertises for the rank, which a prefill rank's agent binds, never all
interfaces) needs an auth token, unless ``auth.allow_insecure_bind = true``; the refusal is one
line. It used to bind a network address with no token, unseen by the fail-closed check.

The manager (``PdStateKVManager``) calls ``check_rank_auth`` with SGLang's ``get_local_ip_auto()``
before it builds its agent: the first test builds a real SGLang 0.5.19 prefill rank's manager (a
child process over SGLang's own code, ``tests/sglang/adapter_probe.py``) advertised at a network
address; the others load the same settings from the environment as a rank loads them
(``load_settings``), without SGLang.
"""

from __future__ import annotations

import pytest

from pdstate.errors import ConfigError
from pdstate.integrations.sglang.settings import check_rank_auth, load_settings
from tests.sglang import runner

TOKEN = "sglang-rank-token-0b7e4f21"
ACK = {"PDSTATE_TRANSFER__MOONCAKE__ALLOW_OPEN_LISTENER": "true"}  # the default engine's open listener, acknowledged
REFUSAL = (
    "auth: this SGLang prefill rank's agent is reachable at 10.1.2.3 (the address SGLang advertises for the rank) "
    "but no auth token is configured; set PDSTATE_AUTH__TOKEN_FILE (or PDSTATE_AUTH__TOKEN) on every prefill and "
    "decode, or PDSTATE_AUTH__ALLOW_INSECURE_BIND=true to run without auth"
)


def test_a_real_sglang_prefill_rank_without_a_token_refuses_to_start_with_one_line():
    try:
        env = runner.ensure_env()
    except runner.EnvUnavailable as exc:
        runner.skip(exc)
    got = runner.run_probe(
        env,
        {"PDSTATE_TRANSFER__ENGINE": "loopback", "SGLANG_HOST_IP": "127.0.0.1"},
        ["auth_refused"],
        300,
        "adapter_probe.py",
    )
    assert "setup" not in got, got["setup"].get("error")
    assert got["auth_refused"]["ok"], got["auth_refused"].get("error")
    assert got["auth_refused"]["refused"] == f"ConfigError: {REFUSAL}"


def test_a_rank_on_a_network_address_without_a_token_refuses_with_one_line():
    settings = load_settings("prefill", environ=ACK)
    with pytest.raises(ConfigError) as info:
        check_rank_auth(settings, "prefill", "10.1.2.3")
    assert str(info.value) == REFUSAL


@pytest.mark.parametrize(
    "environ",
    [{"PDSTATE_AUTH__TOKEN": TOKEN}, {"PDSTATE_AUTH__ALLOW_INSECURE_BIND": "true"}],
)
def test_a_token_or_the_explicit_opt_out_lets_it_start(environ):
    check_rank_auth(load_settings("prefill", environ={**ACK, **environ}), "prefill", "10.1.2.3")


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_loopback_needs_no_token(host):
    check_rank_auth(load_settings("decode", environ=ACK), "decode", host)


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_an_engine_with_an_open_listener_needs_the_acknowledgement(engine):
    environ = {"PDSTATE_TRANSFER__ENGINE": engine, "PDSTATE_AUTH__TOKEN": TOKEN}
    with pytest.raises(ConfigError) as info:
        check_rank_auth(load_settings("prefill", environ=environ), "prefill", "127.0.0.1")
    assert str(info.value) == (
        f"transfer.{engine}.allow_open_listener: the {engine} engine listens on every interface and authenticates "
        "nobody (whoever reaches its ports can write into this worker's registered memory); keep the workers on a "
        f"private network (deploy/k8s/networkpolicy.yaml) and set transfer.{engine}.allow_open_listener = true to "
        "acknowledge it"
    )
    ack = {f"PDSTATE_TRANSFER__{engine.upper()}__ALLOW_OPEN_LISTENER": "true"}
    check_rank_auth(load_settings("prefill", environ={**environ, **ack}), "prefill", "127.0.0.1")


def test_a_weak_token_is_refused_for_a_rank_too():
    with pytest.raises(ConfigError, match=r"^auth\.token: .* is a token of 5 bytes once trimmed"):
        load_settings("prefill", environ={"PDSTATE_AUTH__TOKEN": "short"})
