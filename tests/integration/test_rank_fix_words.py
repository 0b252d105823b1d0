"""Fix lines in SGLang's words on an SGLang rank: for every layout factor of the registry, a peer
refused over that factor shows, on the rank's ``/v1/compat`` and ``/readyz``, the factor's fix line
naming SGLang's flags and variables (``Factor.sglang_line``: the table the preflight's knobs read),
never ``pdstate serve``'s configuration keys; a ``pdstate serve`` worker keeps its own words.

Table-driven over the registry through the status app in process (the rank's source: one that
states its ``rank``), and once through the real rank endpoint (``RankEndpoint``: the child process
an SGLang rank serves its HTTP from, on 127.0.0.1, port 0). The real SGLang pair is
``tests/sglang/test_rank_endpoints.py``.
"""

from __future__ import annotations

import re
import warnings

import httpx
import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from pdstate import errors as e
from pdstate.errors import error_from_wire
from pdstate.integrations.sglang.endpoint import RankEndpoint
from pdstate.integrations.sglang.launch.knobs import knobs
from pdstate.protocol import factors
from pdstate.protocol.report import ErrorInfo
from pdstate.status.api import Readiness, create_app
from tests.integration.test_pushed_endpoint import TOKEN, RankLike
from tests.support.api_source import FakeSource
from tests.support.pools import engine_mismatch_error, tiny
from tests.support.refusals import OWN_PAIR

# pdstate serve's words: its configuration keys and "workers"
SERVE_WORDS = re.compile(r"\b(?:pool|draft|transfer|auth)\.[a-z_]+|\bpreset\b|\bworkers\b")

# The refusals whose class is not ``LayoutMismatch``, built as the handshake builds them.
OWN_CLASS = {
    "page_size": e.PageSizeMismatch.build(64, 256),
    "kv_dtype": e.KVCacheDtypeMismatch.build("bfloat16", "fp8_e4m3"),
    "kv_layout": e.KVLayoutMismatch.build("v4,c4:v4,c128:v4", "v41,c4:v41,c128:v4"),
    "kv_fp8_two_pool": e.CompressedMLAPoolMismatch.build(5, 3, 3, 5),
    "dspark": e.DSparkLayoutMismatch.build(["num_draft_tokens"]),
    "allocation_policy": e.AllocationPolicyMismatch.build("early", "prefill_complete"),
}
# Values for the ``LayoutMismatch`` ones (any other factor: 1 vs 2).
VALUES = {
    "compression_ratios": ([0, 4, 128, 4], [0, 128, 4, 4]),
    "stage": ([0, 43], [0, 21]),
    "draft": ({"layers": 1, "layout": "paged", "page_size": 64, "sliding_window": 128, "ring_size": 4}, None),
    "components": ([["swa", 2, [64, 64]]], [["swa", 3, [64, 64, 64]]]),
    "main_kv_item_lens": ([576, 576], [656, 656]),
    "c4_state_dtype": ("float32", "bfloat16"),
    "c128_state_dtype": ("float32", "bfloat16"),
}


def refusal(name: str) -> ErrorInfo:
    entry = factors.FACTORS[name]
    if name in OWN_CLASS:
        return ErrorInfo.of(OWN_CLASS[name])
    assert entry.error is e.LayoutMismatch, f"{name}: give OWN_CLASS a refusal of {entry.error.__name__}"
    return ErrorInfo.of(e.LayoutMismatch.build(name, *VALUES.get(name, (1, 2))))


def expected(info: ErrorInfo, words: str) -> str:
    """The factor's line from the registry, for the refusal as the wire carries it."""
    err = error_from_wire(info.type, info.message)
    entry = factors.of_error(err)
    assert entry is not None and entry.name == err.factor
    line = entry.sglang_line(err.prefill, err.decode) if words == "sglang" else entry.fix_line(err.prefill, err.decode)
    assert line is not None
    return line


def sglang_names(name: str) -> list[str]:
    """The SGLang flags and variables that can set ``name``: the preflight's knobs, and the entry's flag."""
    entry = factors.FACTORS[name]
    found = [k.heading for k in knobs() if name in k.factors]
    return found + ([entry.flag] if entry.flag else [])


class Rank(RankLike):
    """A rank's source (it states its ``rank``) with one rejected decode and a 503 naming its refusal."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__()
        self.peer_list = [{"id": "dec-1", "state": "rejected", "error": info.model_dump(), "fingerprint": "f" * 32}]
        self.ready = Readiness(False, f"refused: {info.message}", "handshake", info)


def served_documents(client) -> tuple[dict, dict]:
    compat = client.get("/v1/compat")
    ready = client.get("/readyz")
    assert compat.status_code == 200 and ready.status_code == 503
    return compat.json(), ready.json()


@pytest.mark.parametrize("name", list(factors.FACTORS))
def test_every_factor_renders_sglang_words_on_a_rank(name):
    info = refusal(name)
    line = expected(info, "sglang")
    assert line.startswith("fix: ") and not SERVE_WORDS.search(line), line
    names = sglang_names(name)
    assert names and all(n in line for n in names if factors.FACTORS[name].sglang_fix is None), (names, line)
    assert any(n.split()[0] in line for n in names), (names, line)
    compat, ready = served_documents(TestClient(create_app(Rank(info), token=TOKEN)))
    assert compat["peers"][0]["error"]["fix"] == line
    assert ready["error"]["fix"] == line


@pytest.mark.parametrize("name", list(factors.FACTORS))
def test_a_serve_worker_keeps_its_config_words(name):
    info = refusal(name)
    source = FakeSource("prefill", tiny())
    source.peer_list = [{"id": "dec-1", "state": "rejected", "error": info.model_dump()}]
    doc = TestClient(create_app(source)).get("/v1/compat").json()
    assert doc["peers"][0]["error"]["fix"] == expected(info, "serve")


def test_the_rank_endpoint_child_renders_sglang_words():
    info = refusal("draft")
    line = expected(info, "sglang")
    assert line == (
        "fix: launch both servers with the same --page-size; SGLANG_HACK_FLASHMLA_BACKEND=unified_kv_triton "
        "(ROCm unified KV); --speculative-algorithm; --speculative-num-steps (draft tokens); sliding_window "
        "(config.json / --json-model-override-args) (prefill 1-layer paged draft, page 64, window 128, ring 4, "
        "decode none)"
    )
    endpoint = RankEndpoint(Rank(info), "127.0.0.1", 0, TOKEN)
    try:
        with httpx.Client(base_url=endpoint.url, timeout=10) as child:
            compat, ready = served_documents(child)
    finally:
        endpoint.close()
    assert compat["peers"][0]["error"]["fix"] == line
    assert ready["error"]["fix"] == line


# Every other refusal kind with a fix line, as the code produces it, and its line on an SGLang rank
# (``None``: SGLang builds that pair or pool itself, no pdstate setting changes it, upstream's
# message stands alone).


def _auth_error() -> ErrorInfo:
    from pdstate.protocol import wire

    frame = wire.encode(wire.Heartbeat(worker_id="d", incarnation="i", seq=1), b"another-secret")
    with pytest.raises(e.AuthError) as info:
        wire.decode(frame, b"the-right-secret")
    return ErrorInfo.of(info.value)


OTHER_KINDS = {
    "EngineError": (
        engine_mismatch_error(),
        "fix: set PDSTATE_TRANSFER__ENGINE to one engine on both servers (prefill shm, decode mooncake)",
    ),
    "EngineUnavailable": (
        ErrorInfo.of(e.EngineUnavailable("mooncake is not installed: pip install pdstate[mooncake]")),
        "fix: install the extra the message names beside SGLang (an SGLang image ships Mooncake), or set "
        "PDSTATE_TRANSFER__ENGINE to an engine installed on both servers",
    ),
    "AuthError": (
        _auth_error(),
        "fix: give both servers the same secret: PDSTATE_AUTH__TOKEN_FILE (or PDSTATE_AUTH__TOKEN) on both, or on "
        "neither (then run both as one uid with the same PDSTATE_AUTH__KEY_DIR, or copy its key file to both)",
    ),
    "VersionMismatch": (
        ErrorInfo(type="VersionMismatch", message="protocol version mismatch: peer speaks v9, this worker speaks v1"),
        "fix: install the same pdstate version beside both servers (the protocol version is not configurable)",
    ),
    "RoleMismatch": (
        ErrorInfo(type="RoleMismatch", message="both workers are decode workers: a prefill pairs with a decode"),
        "fix: pair a prefill with a decode: launch one of the two with --disaggregation-mode decode",
    ),
    "DescriptorMismatch": (
        ErrorInfo(type="DescriptorMismatch", message="main KV item lengths differ: ours=[1], peer=[2]"),
        "fix: the registered buffers do not pair: install one pdstate version beside both servers and launch them "
        'alike (pdstate check --sglang "PREFILL ARGS" "DECODE ARGS" shows the difference)',
    ),
    "OnlineC128MTPUnsupported": (
        ErrorInfo.of(e.OnlineC128MTPUnsupported()),
        "fix: online C128 with speculative decoding needs SGLANG_EXPERIMENTAL_ONLINE_C128_MTP=1; or unset "
        "SGLANG_OPT_USE_ONLINE_COMPRESS, or remove the --speculative-* flags",
    ),
    **{
        kind: (ErrorInfo.of(exc), None)
        for kind, exc in {
            **{k: v for k, v in OWN_PAIR.items() if k != "OnlineC128MTPUnsupported"},  # its SGLang fix is above
            "PoolConfigError": e.PoolConfigError("unknown dtype 'x'"),
        }.items()
    },
}


def test_every_kind_with_a_fix_is_covered_on_a_rank():
    from pdstate.protocol.fixes import fixes_known

    assert set(fixes_known()) - set(factors.error_kinds()) == set(OTHER_KINDS)


@pytest.mark.parametrize("kind", sorted(OTHER_KINDS))
def test_every_other_refusal_kind_renders_sglang_words_on_a_rank(kind):
    info, line = OTHER_KINDS[kind]
    assert info.type == kind
    compat, ready = served_documents(TestClient(create_app(Rank(info), token=TOKEN)))
    assert compat["peers"][0]["error"]["fix"] == ready["error"]["fix"] == line
    if line is not None:
        assert not SERVE_WORDS.search(line), line
        names = re.search(r"PDSTATE_[A-Z_]+|SGLANG_[A-Z_]+|--[a-z-]+", line)
        assert names or kind == "VersionMismatch", line  # a version is installed, not set
