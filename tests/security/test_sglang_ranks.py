"""SGLang ranks fail closed, as ``pdstate serve`` does: a rank's agent reachable beyond loopback
(the address SGLang advertises for the rank, which a prefill rank's agent binds, never all
interfaces) needs an auth token, unless ``auth.allow_insecure_bind = true``; the refusal is one
line. It used to bind a network address with no token, unseen by the fail-closed check.

The manager (``PdStateKVManager``) calls ``check_rank_auth`` with SGLang's ``get_local_ip_auto()``
before it builds its agent; here the same settings are loaded from the environment as a rank
loads them (``load_settings``), without SGLang.
"""

from __future__ import annotations

import pytest

from pdstate.errors import ConfigError
from pdstate.integrations.sglang.settings import check_rank_auth, load_settings

TOKEN = "sglang-rank-token-0b7e4f21"
REFUSAL = (
    "auth: this SGLang prefill rank's agent is reachable at 10.1.2.3 (the address SGLang advertises for the rank) "
    "but no auth token is configured; set PDSTATE_AUTH__TOKEN_FILE (or PDSTATE_AUTH__TOKEN) on every prefill and "
    "decode, or PDSTATE_AUTH__ALLOW_INSECURE_BIND=true to run without auth"
)


def test_a_rank_on_a_network_address_without_a_token_refuses_with_one_line():
    settings = load_settings("prefill", environ={})
    with pytest.raises(ConfigError) as info:
        check_rank_auth(settings, "prefill", "10.1.2.3")
    assert str(info.value) == REFUSAL


@pytest.mark.parametrize(
    "environ",
    [{"PDSTATE_AUTH__TOKEN": TOKEN}, {"PDSTATE_AUTH__ALLOW_INSECURE_BIND": "true"}],
)
def test_a_token_or_the_explicit_opt_out_lets_it_start(environ):
    check_rank_auth(load_settings("prefill", environ=environ), "prefill", "10.1.2.3")


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_loopback_needs_no_token(host):
    check_rank_auth(load_settings("decode", environ={}), "decode", host)


def test_a_weak_token_is_refused_for_a_rank_too():
    with pytest.raises(ConfigError, match=r"^auth\.token: .* is a token of 5 bytes once trimmed"):
        load_settings("prefill", environ={"PDSTATE_AUTH__TOKEN": "short"})
