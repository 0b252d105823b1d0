"""``pdstate check`` on launch lines copied from published DeepSeek-V4 deployments.

The files under ``tests/preflight/recipes/`` are the published launches, each with its source URL
at its top: SGLang's DeepSeek-V4 cookbook (a verified cell with its PD roles), SGLang's own DSV4 PD
CI pair, NVIDIA srt-slurm's DeepSeek-V4-Pro recipes, and
Dynamo's disaggregated SGLang recipe (its worker is a wrapper launcher with flags of its own).
Correct pairs come out compatible; each one-sided change to them (an abbreviated flag, an exported
variable, a setting kept in SGLang's ``--config`` YAML, a topology pdstate's backend refuses) comes
out INCOMPATIBLE, exit 1, naming the factor and the fix.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdstate.service import preflight
from tests.support.paths import REPO
from tests.support.preflight import model_config

RECIPES = REPO / "tests/preflight/recipes"
CI_PREFILL, CI_DECODE = RECIPES / "sglang-ci-dsv4-prefill.sh", RECIPES / "sglang-ci-dsv4-decode.sh"
COOKBOOK = (
    "--sglang",
    f"@{RECIPES / 'cookbook-dsv4-flash-b200-balanced-prefill.sh'}",
    f"@{RECIPES / 'cookbook-dsv4-flash-b200-balanced-decode.sh'}",
)
SRT_MTP = RECIPES / "srt-slurm-disagg-low-latency-1p1d-tp4-tp4-mtp.yaml"
SRT_DEP = RECIPES / "srt-slurm-disagg-1p1d-dep4-dep16.yaml"
SRT_NIXL = RECIPES / "srt-slurm-disagg-1p1d-tp4-mxfp4.yaml"
CI_SPEC = "--speculative-algorithm EAGLE --speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 2"
AMBIGUOUS = (
    "SGLang would not start: sglang serve: error: ambiguous option: --cuda-graph-max-bs could match "
    "--cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill"
)


def check(capsys, *argv: str) -> tuple[int, str]:
    """``pdstate check ARGV`` through its own argument parser; (exit status, what it printed)."""
    p = argparse.ArgumentParser()
    preflight.configure_check(p)
    args = p.parse_args(list(argv))
    rc = args.func(args)
    out = capsys.readouterr()
    return int(rc), out.out + out.err


def edited(tmp_path: Path, src: Path, *changes: tuple[str, str], name: str | None = None) -> Path:
    """A copy of ``src`` in ``tmp_path`` with each ``(old, new)`` replaced (``old`` must be there)."""
    text = src.read_text()
    for old, new in changes:
        assert old in text, f"{old!r} not in {src.name}"
        text = text.replace(old, new)
    out = tmp_path / (name or src.name)
    out.write_text(text)
    return out


def ci_pair(*argv: str) -> tuple[str, ...]:
    return ("--sglang", f"@{CI_PREFILL}", f"@{CI_DECODE}", *argv)


# --- the published pairs as published ------------------------------------------------------------------


@pytest.mark.parametrize("release", ["0.5.19", "0.5.23"])
def test_the_cookbooks_pd_pair(capsys, release):
    rc, out = check(capsys, *COOKBOOK, "--sglang-version", release, "--strict", "--width", "100")
    assert rc == 0, out
    lines = out.splitlines()
    assert lines[-1] == "compatible"
    assert "14 settings (prefill 7, decode 7) do not affect the state layout (--verbose lists them)" in lines
    assert "not modelled" not in out and "unknown" not in out
    assert len(lines) <= 40 and max(map(len, lines)) <= 100, out  # one screen


@pytest.mark.parametrize("release", ["0.5.19", "0.5.23"])
def test_sglangs_own_dsv4_ci_pair(capsys, release):
    rc, out = check(capsys, *ci_pair("--sglang-version", release))
    if release == "0.5.23":  # its parser has no --cuda-graph-max-bs: the prefix matches two flags
        assert rc == 1, out
        assert f"- the prefill: {AMBIGUOUS}" in out and f"- the decode: {AMBIGUOUS}" in out
        assert "c4_ring" not in out  # both sides still build the same layout
        return
    assert rc == 0, out
    assert out.splitlines()[-1] == "compatible"
    assert "built-in DeepSeek-V4-Flash layout, recognised from 'DeepSeek-V4-Flash-FP8'" in out
    assert "EAGLE (1 steps, 2 draft tokens, 1-layer NextN draft)" in out
    assert "not modelled" not in out and "unknown" not in out


@pytest.mark.parametrize("recipe", [SRT_DEP, SRT_NIXL], ids=lambda p: p.stem)
def test_srt_slurm_deepseek_v4_pro_recipes_that_pair(capsys, recipe):
    rc, out = check(capsys, "--recipe", str(recipe), "--sglang-version", "0.5.19")
    assert rc == 0, out
    assert out.splitlines()[-1] == "compatible"
    assert "[61 layers: 30 C4, 31 C128; built-in DeepSeek-V4-Pro layout" in out
    assert "not modelled" not in out and "unknown" not in out
    rc, out = check(capsys, "--recipe", str(recipe), "--sglang-version", "0.5.23")
    assert rc == 1 and AMBIGUOUS in out


@pytest.mark.parametrize("release", ["0.5.19", "0.5.23"])
def test_srt_slurms_decode_only_abbreviated_speculation(capsys, release):
    """The published recipe writes ``speculative-algo: "EAGLE"`` on the decode only."""
    rc, out = check(capsys, "--recipe", str(SRT_MTP), "--sglang-version", release)
    assert rc == 1, out
    lines = out.splitlines()
    assert "- --speculative-algorithm: prefill off, decode EAGLE (3 steps, 4 draft tokens)" in lines
    assert any(line.startswith("  c4_ring: 8 vs 16 -> ") for line in lines)
    assert any(line.startswith("  draft: none vs 1-layer paged draft") for line in lines)
    assert (
        "  fix: add `--speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1 "
        "--speculative-num-draft-tokens 4` to the prefill (or remove the --speculative-* flags from the decode)"
    ) in lines
    assert not any(line.startswith("compatible") for line in lines)


def test_the_report_on_a_published_pair_fits_on_one_screen(capsys):
    for argv in (("--recipe", str(SRT_MTP)), ci_pair(), COOKBOOK):
        rc, out = check(capsys, *argv, "--sglang-version", "0.5.19", "--width", "100")
        lines = out.splitlines()
        assert len(lines) <= 40, out
        assert max(map(len, lines)) <= 100, out
    assert rc == 0


# --- one-sided changes to SGLang's CI pair -------------------------------------------------------------


def test_the_abbreviated_spelling_on_one_side_reads_the_same(capsys, tmp_path):
    decode = edited(tmp_path, CI_DECODE, ("--speculative-algorithm EAGLE", "--speculative-algo EAGLE"))
    rc, out = check(capsys, "--sglang", f"@{CI_PREFILL}", f"@{decode}", "--sglang-version", "0.5.19")
    assert rc == 0, out
    assert out.splitlines()[-1] == "compatible"


def test_speculation_dropped_from_the_prefill(capsys, tmp_path):
    prefill = edited(tmp_path, CI_PREFILL, ("  --speculative-algorithm EAGLE \\\n", ""))
    rc, out = check(capsys, "--sglang", f"@{prefill}", f"@{CI_DECODE}", "--sglang-version", "0.5.19")
    assert rc == 1, out
    assert "- --speculative-algorithm: prefill off, decode EAGLE (1 steps, 2 draft tokens)" in out
    assert f"fix: add `{CI_SPEC}` to the prefill" in out


def test_an_exported_variable_on_one_side(capsys, tmp_path):
    online = "export SGLANG_OPT_USE_ONLINE_COMPRESS=1\nexport SGLANG_EXPERIMENTAL_ONLINE_C128_MTP=1\n"
    prefill = edited(tmp_path, CI_PREFILL, ("export SGLANG_DSV4_FP4_EXPERTS=0\n", online))
    rc, out = check(capsys, "--sglang", f"@{prefill}", f"@{CI_DECODE}", "--sglang-version", "0.5.19")
    assert rc == 1, out
    assert "- SGLANG_OPT_USE_ONLINE_COMPRESS (online C128): prefill on, decode off" in out
    assert (
        "fix: set SGLANG_OPT_USE_ONLINE_COMPRESS=1 on the decode too with SGLANG_EXPERIMENTAL_ONLINE_C128_MTP=1 "
        "(or unset it on the prefill)"
    ) in out


SPEC_LINES = (
    "  --speculative-algorithm EAGLE \\\n  --speculative-num-steps 1 \\\n  --speculative-eagle-topk 1 \\\n"
    "  --speculative-num-draft-tokens 2 \\\n"
)


def test_a_setting_kept_only_in_sglangs_config_yaml(capsys, tmp_path):
    (tmp_path / "spec.yaml").write_text(
        "speculative-algorithm: EAGLE\nspeculative-num-steps: 1\nspeculative-eagle-topk: 1\n"
        "speculative-num-draft-tokens: 2\n"
    )
    decode = edited(tmp_path, CI_DECODE, (SPEC_LINES, "  --config spec.yaml \\\n"))
    rc, out = check(capsys, "--sglang", f"@{CI_PREFILL}", f"@{decode}", "--sglang-version", "0.5.19")
    assert rc == 0, out  # the decode's speculation, now in its YAML only, is read
    assert f"note: --config {tmp_path / 'spec.yaml'} read as SGLang merges it (the command line wins)" in out
    prefill = edited(tmp_path, CI_PREFILL, (SPEC_LINES, ""))
    rc, out = check(capsys, "--sglang", f"@{prefill}", f"@{decode}", "--sglang-version", "0.5.19")
    assert rc == 1, out
    assert "- --speculative-algorithm: prefill off, decode EAGLE (1 steps, 2 draft tokens)" in out
    assert f"fix: add `{CI_SPEC}` to the prefill" in out


# --- pdstate's own backend on SGLang's CI pair ---------------------------------------------------------

PDSTATE = ("--disaggregation-transfer-backend mooncake", "--disaggregation-transfer-backend pdstate")


def pdstate_pair(tmp_path: Path, prefill=(), decode=()) -> tuple[str, ...]:
    p = edited(tmp_path, CI_PREFILL, PDSTATE, *prefill)
    d = edited(tmp_path, CI_DECODE, PDSTATE, *decode)
    return ("--sglang", f"@{p}", f"@{d}")


@pytest.mark.parametrize("release", ["0.5.19", "0.5.23"])
def test_pdstates_backend_on_the_ci_pair(capsys, tmp_path, release):
    graphs = ("--cuda-graph-max-bs 128", "--cuda-graph-max-bs-decode 128")  # a flag both releases know
    rc, out = check(capsys, *pdstate_pair(tmp_path, (graphs,), (graphs,)), "--sglang-version", release)
    assert rc == 0, out
    assert out.splitlines()[-1] == "compatible"


@pytest.mark.parametrize(
    "prefill, decode, said",
    [
        pytest.param(
            (("  --tp 4 \\\n", "  --tp 4 \\\n  --pp-size 2 \\\n"),),
            (),
            [
                "- the prefill: SGLang would not start: ValueError from pdstate's KV manager: pdstate's SGLang "
                "backend does not move a draft model's KV from a pipeline-parallel prefill yet (pp_size=2): use "
                "--disaggregation-transfer-backend mooncake"
            ],
            id="pipeline-parallelism-with-the-ci-pairs-draft",
        ),
        pytest.param(
            (("  --tp 4 \\\n", "  --tp 4 \\\n  --attn-cp-size 2 \\\n  --enable-prefill-cp \\\n"),),
            (),
            [
                "- the prefill: SGLang would not start: ValueError from pdstate's KV manager: pdstate's SGLang "
                "backend does not support context parallelism yet (attn_cp_size=2, attn_dcp_size=1): use "
                "--disaggregation-transfer-backend mooncake"
            ],
            id="context-parallelism",
        ),
    ],
)
def test_a_topology_pdstates_backend_refuses(capsys, tmp_path, prefill, decode, said):
    rc, out = check(capsys, *pdstate_pair(tmp_path, prefill, decode), "--sglang-version", "0.5.19")
    assert rc == 1, out
    lines = out.splitlines()
    for line in said:
        assert any(x.startswith(line) for x in lines), (line, out)
    assert not any(x.startswith("compatible") for x in lines)


def test_a_decode_attention_tp_wider_than_the_prefills_with_pdstates_backend(capsys, tmp_path):
    """Served: each prefill rank sends the whole request to every decode rank SGLang maps to it."""
    graphs = ("--cuda-graph-max-bs 128", "--cuda-graph-max-bs-decode 128")
    wider = ("  --dp 4 \\\n  --enable-dp-attention \\\n", "")
    rc, out = check(capsys, *pdstate_pair(tmp_path, (graphs,), (graphs, wider)), "--sglang-version", "0.5.19")
    assert rc == 0, out
    assert out.splitlines()[-1] == "compatible"


@pytest.mark.parametrize("release", ["0.5.19", "0.5.23"])
def test_a_decode_radix_cache_with_pdstates_backend(capsys, tmp_path, release):
    graphs = ("--cuda-graph-max-bs 128", "--cuda-graph-max-bs-decode 128")
    radix = (
        "  --watchdog-timeout 900 \\\n",
        "  --watchdog-timeout 900 \\\n  --disaggregation-decode-enable-radix-cache \\\n",
    )
    rc, out = check(capsys, *pdstate_pair(tmp_path, (graphs,), (graphs, radix)), "--sglang-version", release)
    if release == "0.5.19":  # SGLang itself refuses a decode radix cache with speculative decoding there
        assert rc == 1, out
        assert (
            "- the decode: SGLang would not start: ValueError: --disaggregation-decode-enable-radix-cache is "
            "incompatible with speculative decoding (--speculative-algorithm EAGLE" in out
        )
    else:  # pdstate's backend serves it: only the pages past the decode's prefix move
        assert rc == 0, out


# --- a wrapper launcher: Dynamo's SGLang worker ---------------------------------------------------------


def test_dynamos_worker_with_its_own_flags_and_sglangs_config_yaml(capsys, tmp_path):
    pair = ("--sglang", f"@{RECIPES / 'dynamo-dsv41-flash-prefill.sh'}", f"@{RECIPES / 'dynamo-dsv41-flash-decode.sh'}")
    rc, out = check(capsys, *pair, "--sglang-version", "0.5.23")
    assert rc == 2
    assert out.strip() == (
        "pdstate check: cannot tell the layer layout of model 'deepseek-ai/DeepSeek-V4.1-Flash': give its "
        "config.json with --model-config PATH (built in: DeepSeek-V4-Flash, DeepSeek-V4-Pro and their FP8/NVFP4 "
        "checkpoints)"
    )
    # With a stand-in config (DeepSeek-V4-Flash's fields: V4.1's own are not published in pdstate), the
    # rest of the launch is read: the worker's --dyn-* flags are its own, SGLang's come from --config.
    rc, out = check(capsys, *pair, "--sglang-version", "0.5.23", "--model-config", model_config(tmp_path))
    assert rc == 0, out
    assert (
        "  note: python3 -m dynamo.sglang's own flags, not SGLang's: --dyn-reasoning-parser deepseek_v41 "
        "--dyn-tool-call-parser deepseek_v41 --dyn-enable-structural-tag"
    ) in out
    assert f"note: --config {RECIPES / 'dynamo-dsv41-flash-decode.yaml'} read as SGLang merges it" in out
    assert "not modelled" not in out
    # SGLang 0.5.23 dropped --prefill-round-robin-balance (0.5.19 knows it): the one unknown setting
    assert (
        "  unknown: --prefill-round-robin-balance (SGLang 0.5.23's parser does not know it: SGLang exits with "
        "'unrecognized arguments' unless a wrapper takes it)"
    ) in out.splitlines()
    assert out.count("unknown:") == 1
    assert out.splitlines()[-1] == "compatible (see 'unknown' above)"
    rc, out = check(capsys, *pair, "--sglang-version", "0.5.23", "--model-config", model_config(tmp_path), "--strict")
    assert rc == 1
    assert out.splitlines()[-1] == "not confirmed (--strict): 1 setting unknown to SGLang's parser above"
    assert not any(line.startswith("compatible") for line in out.splitlines())
    rc, out = check(capsys, *pair, "--sglang-version", "0.5.19", "--model-config", model_config(tmp_path), "--strict")
    assert rc == 0, out
    assert "unknown" not in out and out.splitlines()[-1] == "compatible"


# --- DeepSeek-V4-Pro built in ------------------------------------------------------------------------------


def test_deepseek_v4_pros_published_layout():
    """huggingface.co/deepseek-ai/DeepSeek-V4-Pro/blob/main/config.json: 61 layers, compress_ratios
    [128, 128, 4, 128, ..., 4, 0] (62 entries, the NextN layer's 0 last), sliding_window 128,
    head_dim 512, qk_rope_head_dim 64, index_head_dim 128, one NextN layer."""
    from pdstate.integrations.sglang.launch.model import builtin_pro_config

    cfg = builtin_pro_config()
    ratios = cfg["compress_ratios"]
    assert len(ratios) == 62 and cfg["num_hidden_layers"] == 61 and ratios[-1] == 0
    assert ratios[:5] == [128, 128, 4, 128, 4] and ratios[59:61] == [128, 4]
    layers = ratios[:61]
    assert (layers.count(4), layers.count(128)) == (30, 31)
    assert [i for i, r in enumerate(layers) if r == 4] == list(range(2, 61, 2))
    dims = {k: cfg[k] for k in ("sliding_window", "head_dim", "qk_rope_head_dim", "index_head_dim")}
    assert dims == {"sliding_window": 128, "head_dim": 512, "qk_rope_head_dim": 64, "index_head_dim": 128}
    assert cfg["num_nextn_predict_layers"] == 1


@pytest.mark.parametrize(
    "name, said",
    [
        ("deepseek-ai/DeepSeek-V4-Pro", "built-in DeepSeek-V4-Pro layout]"),
        ("nvidia/DeepSeek-V4-Pro-NVFP4", "built-in DeepSeek-V4-Pro layout, recognised from 'DeepSeek-V4-Pro-NVFP4'"),
        ("/models/dsv4-pro", "built-in DeepSeek-V4-Pro layout, recognised from 'dsv4-pro'"),
    ],
)
def test_deepseek_v4_pro_is_recognised_by_name(capsys, name, said):
    rc, out = check(
        capsys,
        "--sglang",
        f"--model-path {name} --disaggregation-mode prefill",
        f"--model-path {name} --disaggregation-mode decode",
    )
    assert rc == 0, out
    assert said in out and "61 layers: 30 C4, 31 C128" in out


def test_a_dated_pro_checkpoint_asks_for_its_config(capsys):
    rc, out = check(
        capsys,
        "--sglang",
        "--model-path deepseek-ai/DeepSeek-V4-Pro-0813 --disaggregation-mode prefill",
        "--model-path deepseek-ai/DeepSeek-V4-Pro-0813 --disaggregation-mode decode",
    )
    assert rc == 2
    assert "is a DeepSeek-V4-Pro checkpoint other than the published DeepSeek-V4-Pro" in out
