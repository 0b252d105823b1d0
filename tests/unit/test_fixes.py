"""``protocol.fixes``: every refusal kind gets a ``fix:`` line naming a real ``WorkerConfig`` key.

Refusals are produced by the real code (errors' builders, ``compat`` on reports of real pools, the
wire codec, pool construction), never typed by hand, so a changed message shape shows up here.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from pydantic import BaseModel

from pdstate import errors as e
from pdstate.pools.presets import PoolSettings, build_worker_pools, preset
from pdstate.protocol import compat, wire
from pdstate.protocol.fixes import (
    compare_layers,
    fix_line,
    fixes_known,
    parse_layout_mismatch,
    summarize,
)
from pdstate.protocol.report import ErrorInfo
from pdstate.service import preflight
from pdstate.settings.config import WorkerConfig
from tests.support.pools import engine_mismatch_error, report_of
from tests.support.preflight import run_check
from tests.support.refusals import OWN_PAIR

KEY_RE = re.compile(r"\b(role|preset|(?:pool|draft|checks|control|http|transfer|auth)\.[a-z0-9_]+(?:\.[a-z0-9_]+)?)\b")
FLASH_SMALL = preset("dsv4-flash").with_(full_tokens=1024, swa_tokens=512, max_num_reqs=1)
LAYOUTS = preflight.preset_layouts()


def config_keys(model: type[BaseModel] = WorkerConfig, prefix: str = "") -> set[str]:
    keys = set()
    for name, f in model.model_fields.items():
        keys.add(prefix + name)
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys |= config_keys(ann, f"{prefix}{name}.")
    return keys


KEYS = config_keys()


def assert_names_real_keys(fix: str | None) -> list[str]:
    assert fix is not None and fix.startswith("fix: "), fix
    named = KEY_RE.findall(fix)
    assert named, f"no config key in {fix!r}"
    unknown = [k for k in named if k not in KEYS]
    assert not unknown, f"{unknown} are not WorkerConfig keys ({fix!r})"
    return named


def cross(a: PoolSettings, b: PoolSettings) -> list[ErrorInfo]:
    return compat.compat_errors(report_of(a), report_of(b), "prefill")


def layout_errors() -> dict[str, ErrorInfo]:
    """One real ``LayoutMismatch`` per factor (first occurrence), plus the two upstream sentences."""
    t = preset("tiny")
    pairs = [
        (t, t.with_(unified_kv=True)),
        (t, FLASH_SMALL),
        (t, t.with_(sliding_window=64)),
        (t, t.with_(speculative_num_draft_tokens=None, draft_enabled=False)),
        (t.with_(draft_enabled=False), t),
        (t, t.with_(online_c128=True, online_c128_mtp=True)),
        (t, t.with_(state_dtype="bfloat16")),
        (t, t.with_(draft_layers=2)),
        (t, t.with_(page_size=512, swa_page_size=512, full_tokens=2048)),
        (t, t.with_(kv_dtype="float8_e5m2")),
        (t.with_(unified_kv=True), t.with_(unified_kv=True, speculative_num_draft_tokens=8)),
    ]
    found: dict[str, ErrorInfo] = {}
    for a, b in pairs:
        for err in cross(a, b):
            parsed = parse_layout_mismatch(err.message)
            key = f"LayoutMismatch:{parsed[0]}" if parsed else err.type
            found.setdefault(key, err)
    return found


LAYOUT = layout_errors()


def test_every_layout_factor_and_cross_side_sentence_is_covered():
    from pdstate.protocol.report import FACTOR_NAMES

    expected = {f"LayoutMismatch:{n}" for n in FACTOR_NAMES} | {"PageSizeMismatch", "KVCacheDtypeMismatch"}
    assert expected <= set(LAYOUT)


@pytest.mark.parametrize("key", sorted(LAYOUT))
def test_cross_side_refusal_names_a_real_key_and_both_sides(key):
    err = LAYOUT[key]
    fix = fix_line(err.type, err.message, LAYOUTS)
    assert_names_real_keys(fix)
    assert "both workers" in fix or ("prefill" in fix and "decode" in fix), fix


def test_upstream_sentence_comes_first_then_the_pdstate_key():
    page = fix_line(LAYOUT["PageSizeMismatch"].type, LAYOUT["PageSizeMismatch"].message)
    assert page.startswith("fix: Both servers must use the same --page-size value: in pdstate, set pool.page_size")
    assert "prefill 256, decode 512" in page
    dtype = fix_line(LAYOUT["KVCacheDtypeMismatch"].type, LAYOUT["KVCacheDtypeMismatch"].message)
    assert dtype.startswith("fix: Both servers must use the same --kv-cache-dtype value: in pdstate, set pool.kv_dtype")
    assert "prefill float8_e4m3fn, decode float8_e5m2" in dtype


def test_speculative_on_one_side_names_the_speculative_keys():
    fix = fix_line("LayoutMismatch", LAYOUT["LayoutMismatch:c4_ring"].message)
    assert "pool.speculative_num_draft_tokens" in fix and "draft.enabled" in fix
    t = preset("tiny")
    errs = cross(t, t.with_(speculative_num_draft_tokens=None, draft_enabled=False))
    draft = next(x for x in errs if x.message.startswith("DSV4 layout mismatch on draft"))
    assert "only the prefill has a draft: set draft.enabled = true on the decode" in fix_line(draft.type, draft.message)


def test_online_c128_ring_names_online_key():
    errs = cross(preset("tiny"), preset("tiny").with_(online_c128=True, online_c128_mtp=True))
    ring = next(x for x in errs if x.message.startswith("DSV4 layout mismatch on c128_ring"))
    assert "pool.online_c128" in fix_line(ring.type, ring.message)


# --- a preset mismatch names the presets, not 43-entry lists -----------------------------------


def test_preset_mismatch_names_the_presets():
    err = LAYOUT["LayoutMismatch:compression_ratios"]
    assert "[0, 0, 4, 128" in err.message  # what the handshake carries
    short = summarize(err.type, err.message, LAYOUTS)
    assert short == (
        "DSV4 layout mismatch on compression_ratios: prefill preset 'tiny' (3 layers: 1 SWA-only, 1 C4, 1 C128), "
        "decode preset 'dsv4-flash' (43 layers: 2 SWA-only, 21 C4, 20 C128). Both servers must build the same "
        "state layout."
    )
    fix = fix_line(err.type, err.message, LAYOUTS)
    assert_names_real_keys(fix)
    assert "preset 'tiny'" in fix and "preset 'dsv4-flash'" in fix and "[0, 0" not in fix


def test_same_layers_in_another_order_is_said_so():
    flash = LAYOUTS["preset 'dsv4-flash'"]
    swapped = [0, 0] + [128, 4] * 20 + [4]
    text = compare_layers(flash, swapped, LAYOUTS)
    assert "decode 43 layers: 2 SWA-only, 21 C4, 20 C128, not a known layout" in text
    assert "the same layers in another order (first at layer 2: 4 vs 128)" in text


def test_long_components_are_summarised():
    err = LAYOUT["LayoutMismatch:components"]
    short = summarize(err.type, err.message, LAYOUTS)
    assert len(short) < len(err.message)
    assert "swa[" in short


# --- the refusals that are not layout factors ---------------------------------------------------


def _pool_error() -> BaseException:
    with pytest.raises(e.PoolConfigError) as info:
        build_worker_pools(preset("tiny").with_(kv_dtype="bfloat16"))
    return info.value


def _auth_error(sent: bytes | None) -> BaseException:
    frame = wire.encode(wire.Heartbeat(worker_id="d", incarnation="i", seq=1), sent)
    with pytest.raises(e.AuthError) as info:
        wire.decode(frame, b"the-right-secret")
    return info.value


@pytest.mark.parametrize("name", sorted(OWN_PAIR))
def test_own_pair_refusal_names_a_real_key(name):
    exc = OWN_PAIR[name]
    assert type(exc).__name__ == name
    assert_names_real_keys(fix_line(name, str(exc)))


def test_mapping_fix_keeps_the_upstream_advice_and_names_draft_mapping():
    fix = fix_line("SWAIndexMappingNotShared", str(e.SWAIndexMappingNotShared()))
    assert fix.startswith("fix: register the allocator's full_to_swa_index_mapping on the draft pool")
    assert 'draft.mapping = "shared"' in fix


@pytest.mark.parametrize("sent", [None, b"another-secret"])
def test_auth_refusal_names_the_token_file(sent):
    exc = _auth_error(sent)
    assert "auth.token_file" in assert_names_real_keys(fix_line(type(exc).__name__, str(exc)))


def test_engine_mismatch_names_transfer_engine_and_both_engines():
    err = engine_mismatch_error()
    fix = fix_line(err.type, err.message)
    assert assert_names_real_keys(fix) == ["transfer.engine"]
    assert "prefill shm, decode mooncake" in fix


def test_engine_unavailable_and_pool_config_and_descriptor_and_role():
    cases = [
        ("EngineUnavailable", str(e.EngineUnavailable("mooncake is not installed: pip install pdstate[mooncake]"))),
        ("PoolConfigError", str(_pool_error())),
        ("DescriptorMismatch", "main KV item lengths differ: ours=[1], peer=[2]"),
        ("RoleMismatch", "both workers are decode workers: a prefill pairs with a decode"),
    ]
    for typ, msg in cases:
        assert_names_real_keys(fix_line(typ, msg))
    assert "pool.kv_dtype" in fix_line("PoolConfigError", str(_pool_error()))


def test_version_mismatch_says_what_to_do_without_a_key():
    fix = fix_line("VersionMismatch", "protocol version mismatch: peer speaks v9, this worker speaks v1")
    assert fix == "fix: run the same pdstate version on both workers (the protocol version is not configurable)"


SGLANG_0523 = {
    "KVLayoutMismatch": "fix: launch both servers with the same --dsv4-attn-backend and SGLANG_DSV4_KV_LAYOUT",
    "CompressedMLAPoolMismatch": "fix: set SGLANG_DSV4_UNIFIED_KV_FP8 the same on both servers",
    "DSparkLayoutMismatch": (
        "fix: enable DSpark on both servers with the same block size and target/draft KV layout "
        "(upgrade both servers together)"
    ),
    "AllocationPolicyMismatch": "fix: set --disaggregation-decode-allocation-policy identically on both servers",
}


SGLANG_0523_REFUSALS = [
    e.KVLayoutMismatch.build("v4,c4:v4,c128:v4", "v41,c4:v41,c128:v4"),
    e.CompressedMLAPoolMismatch.build(5, 3, 3, 5),
    e.DSparkLayoutMismatch.build(["num_draft_tokens"]),
    e.AllocationPolicyMismatch.build("early", "prefill_complete"),
]


@pytest.mark.parametrize("refusal", SGLANG_0523_REFUSALS, ids=lambda r: type(r).__name__)
def test_sglang_0523_refusals_name_the_server_setting(refusal):
    kind = type(refusal).__name__
    assert fix_line(kind, str(refusal)) == SGLANG_0523[kind]


def test_every_kind_with_a_fix_is_tested_here():
    tested = set(OWN_PAIR) | {"PageSizeMismatch", "KVCacheDtypeMismatch", "LayoutMismatch", "AuthError"}
    tested |= set(SGLANG_0523)
    tested |= {"EngineError", "EngineUnavailable", "PoolConfigError", "DescriptorMismatch", "RoleMismatch"}
    tested |= {"VersionMismatch"}
    assert set(fixes_known()) == tested


def test_unknown_kinds_and_odd_messages_do_not_raise():
    assert fix_line("TransferFailed", "deadline exceeded") is None
    assert fix_line("LayoutMismatch", "something else entirely").startswith("fix: set preset, [pool] and [draft]")
    assert summarize("LayoutMismatch", "not the usual shape") == "not the usual shape"


def test_fixes_module_does_not_import_torch():
    code = "import sys, pdstate.protocol.fixes; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --- pdstate check CONFIG CONFIG prints a fix under each problem -------------------------------


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


SMALL_FLASH = "[pool]\nfull_tokens = 1024\nswa_tokens = 512\nmax_num_reqs = 1\n"


def test_config_check_prints_a_fix_under_each_problem(tmp_path, capsys):
    pre = write(tmp_path, "p.toml", 'role = "prefill"\npreset = "tiny"\n')
    dec = write(tmp_path, "d.toml", 'role = "decode"\npreset = "dsv4-flash"\n' + SMALL_FLASH)
    rc, out, err = run_check([pre, dec], capsys)
    assert rc == 1
    lines = err.splitlines()
    problems = [i for i, line in enumerate(lines) if not line.startswith("  ")]
    assert problems
    for i in problems:
        assert lines[i + 1].startswith("  fix: "), lines[i : i + 2]
    assert (
        "pair: LayoutMismatch: DSV4 layout mismatch on compression_ratios: prefill preset 'tiny' (3 layers: "
        "1 SWA-only, 1 C4, 1 C128), decode preset 'dsv4-flash' (43 layers: 2 SWA-only, 21 C4, 20 C128)."
    ) in err
    assert "[0, 0, 4, 128, 4, 128" not in err


def test_config_check_engine_and_mapping(tmp_path, capsys):
    pre = write(tmp_path, "p.toml", 'role = "prefill"\n[transfer]\nengine = "mooncake"\n')
    dec = write(tmp_path, "d.toml", 'role = "decode"\n[draft]\nmapping = "own"\n')
    rc, _, err = run_check([pre, dec], capsys)
    assert rc == 1
    assert (
        "pair: EngineError: transfer engine mismatch: prefill server uses 'mooncake', but decode server uses 'shm'"
        in err
    )
    assert "  fix: set transfer.engine to one engine on both workers (prefill mooncake, decode shm)" in err
    assert f"{dec}: SWAIndexMappingNotShared: DSV4 target and draft pools must share the SWA index mapping" in err
    assert 'draft.mapping = "shared"' in err


def test_config_check_compatible(tmp_path, capsys):
    pre = write(tmp_path, "p.toml", 'role = "prefill"\n')
    dec = write(tmp_path, "d.toml", 'role = "decode"\n')
    rc, out, _ = run_check([pre, dec], capsys)
    assert rc == 0 and out.splitlines()[-1] == "compatible"


def test_config_check_usage_errors(tmp_path, capsys):
    rc, _, err = run_check([], capsys)
    assert rc == 2 and "nothing to check" in err
    rc, _, err = run_check([str(tmp_path / "missing.toml")], capsys)
    assert rc == 2 and "config file not found" in err
