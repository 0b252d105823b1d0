"""``pdstate check --sglang`` on launch lines as operators copy them from published DSV4 recipes.

Each case of issue 26's "Why" list is a test here: SGLang's own parser (prefixes, nargs), launch
scripts (``export`` lines), SGLang's ``--config`` YAML, recipe files, the pdstate backend's own
refusals, the models, and the noise. Every test runs once per SGLang release pdstate models.
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

import pytest

from pdstate.integrations.sglang import releases
from pdstate.service import preflight
from tests.support.paths import REPO
from tests.support.preflight import model_config

RELEASES = releases.versions()  # the table's (``pdstate.integrations.sglang.releases``)
_release: list[str] = []

SPEC = "--speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
FLASH = "--model-path deepseek-ai/DeepSeek-V4-Flash --trust-remote-code"


@pytest.fixture(autouse=True, params=RELEASES, ids=lambda r: f"sglang-{r}")
def release(request):
    _release[:] = [request.param]
    yield request.param
    _release.clear()


def check(capsys, prefill: str | None, decode: str | None, *extra: str) -> tuple[int, str]:
    p = argparse.ArgumentParser()
    preflight.configure_check(p)
    if "--sglang-version" not in extra:
        extra = (*extra, "--sglang-version", *_release)
    argv = ["--sglang", prefill, decode] if prefill is not None else []
    args = p.parse_args([*argv, *extra])
    rc = args.func(args)
    out = capsys.readouterr()
    return int(rc), out.out + out.err


# --- SGLang's own parser: abbreviations, nargs ------------------------------------------------------

# NVIDIA's DeepSeek-V4 disaggregated recipe writes the speculative flags on the decode only, the
# algorithm abbreviated as SGLang's parser accepts it (argparse's allow_abbrev).
NV_DECODE = (
    f"{FLASH} --disaggregation-mode decode --tp 8 --dp 8 --enable-dp-attention "
    "--speculative-algo EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
)
NV_PREFILL = f"{FLASH} --disaggregation-mode prefill --tp 8"


def flash_pair(prefill: str, decode: str) -> tuple[str, str]:
    """DeepSeek-V4-Flash's prefill and decode launch lines, each side with its own flags."""
    return f"{FLASH} --disaggregation-mode prefill {prefill}", f"{FLASH} --disaggregation-mode decode {decode}"


def test_an_abbreviated_flag_is_read_as_sglang_reads_it(capsys):
    rc, out = check(capsys, NV_PREFILL, NV_DECODE)
    assert rc == 1, out
    assert "- --speculative-algorithm: prefill off, decode EAGLE (3 steps, 4 draft tokens)" in out
    assert "c4_ring: 8 vs 16" in out
    assert "draft: none vs 1-layer paged draft" in out
    assert f"fix: add `{SPEC}` to the prefill" in out
    assert "not modelled: --speculative-algo" not in out


def test_the_abbreviated_and_spelled_out_pairs_agree(capsys):
    spelled = NV_DECODE.replace("--speculative-algo ", "--speculative-algorithm ")
    rc1, out1 = check(capsys, NV_PREFILL, NV_DECODE)
    rc2, out2 = check(capsys, NV_PREFILL, spelled)
    assert rc1 == rc2 == 1
    assert out1.split("INCOMPATIBLE")[1] == out2.split("INCOMPATIBLE")[1]


def test_multi_value_flags_take_their_values(capsys, release):
    rc, out = check(capsys, f"{NV_PREFILL} {SPEC} --cuda-graph-bs 8 16 32", f"{NV_DECODE} --cuda-graph-bs 8 16 32")
    assert "not modelled: 16" not in out and "unknown: 16" not in out
    if release == "0.5.19":  # a deprecated spelling of --cuda-graph-bs-decode, three values
        assert rc == 0, out
        assert "--cuda-graph-bs is deprecated in SGLang (use --cuda-graph-bs-decode)" in out
    else:  # 0.5.23 dropped it: the prefix matches two flags, and SGLang stops
        assert rc == 1
        assert (
            "SGLang would not start: sglang serve: error: ambiguous option: --cuda-graph-bs could match "
            "--cuda-graph-bs-decode, --cuda-graph-bs-prefill" in out
        )


def test_a_value_sglang_refuses_stops_it_and_the_rest_is_still_read(capsys):
    rc, out = check(
        capsys,
        f"{NV_PREFILL} {SPEC} --kv-cache-dtype fp9",
        NV_DECODE.replace("--speculative-algo ", "--speculative-algorithm "),
    )
    assert rc == 1
    assert (
        "- the prefill: SGLang would not start: sglang serve: error: argument --kv-cache-dtype: invalid choice: 'fp9'"
        in out
    )
    assert "c4_ring" not in out  # the speculative flags after it were read


# --- launch scripts ------------------------------------------------------------------------------------


def test_exported_variables_in_a_script_are_the_servers_environment(tmp_path, capsys):
    script = tmp_path / "prefill.sh"
    script.write_text(
        textwrap.dedent(
            """\
            #!/bin/bash
            set -ex
            export SGLANG_OPT_USE_ONLINE_COMPRESS=1
            export GLOO_SOCKET_IFNAME=eth0
            MODEL=deepseek-ai/DeepSeek-V4-Flash
            mkdir -p /tmp/logs
            python3 -m sglang.launch_server --model-path $MODEL --trust-remote-code \\
              --disaggregation-mode prefill --tp 8 2>&1 | tee /tmp/logs/prefill.log
            """
        )
    )
    rc, out = check(capsys, f"@{script}", f"{FLASH} --disaggregation-mode decode --tp 8")
    assert rc == 1, out
    assert "- SGLANG_OPT_USE_ONLINE_COMPRESS (online C128): prefill on, decode off" in out
    assert "fix: set SGLANG_OPT_USE_ONLINE_COMPRESS=1 on the decode too (or unset it on the prefill)" in out
    assert "2 other command lines of the script skipped" in out
    assert "GLOO_SOCKET_IFNAME" not in out and "unknown" not in out


def test_exports_inside_shell_blocks_are_read_and_said(tmp_path, capsys):
    script = tmp_path / "prefill.sh"
    script.write_text(
        textwrap.dedent(
            """\
            #!/bin/bash
            if [ "$CONC" = "1" ]; then
                MEM=0.9
            else
                export SGLANG_OPT_USE_ONLINE_COMPRESS=1
            fi
            python3 -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V4-Flash --disaggregation-mode prefill
            """
        )
    )
    rc, out = check(capsys, f"@{script}", f"{FLASH} --disaggregation-mode decode")
    assert rc == 1, out
    assert (
        "note: export lines inside shell blocks (if/case/for) read as if they ran: SGLANG_OPT_USE_ONLINE_COMPRESS "
        "(the last value written wins; check the branch your deployment takes)"
    ) in out
    assert "- SGLANG_OPT_USE_ONLINE_COMPRESS (online C128): prefill on, decode off" in out
    assert "other command line" not in out  # if/else/fi are the shell's structure, not commands


def test_sglang_serve_and_a_wrapper_launcher(capsys):
    rc, out = check(
        capsys,
        f"SGLANG_OPT_USE_ONLINE_COMPRESS=1 sglang serve {FLASH} --disaggregation-mode prefill --tp 8",
        "SGLANG_OPT_USE_ONLINE_COMPRESS=1 srun --nodes 2 --ntasks-per-node 1 numactl --cpunodebind 0 "
        f"python3 -m sglang.launch_server {FLASH} --disaggregation-mode decode --tp 8",
    )
    assert rc == 0, out
    assert (
        "note: run by srun --nodes 2 --ntasks-per-node 1 numactl --cpunodebind 0 (its own flags are not SGLang's)"
        in out
    )
    assert out.splitlines()[-1] == "compatible"


@pytest.mark.parametrize(
    "wrapper, said",
    [
        ("docker run --gpus all -e SGLANG_OPT_USE_ONLINE_COMPRESS=1 lmsysorg/sglang:latest", "docker run"),
        ("podman run --env=SGLANG_OPT_USE_ONLINE_COMPRESS=1 sglang", "podman run"),
        ("srun --export=ALL,SGLANG_OPT_USE_ONLINE_COMPRESS=1 --nodes 1", "srun"),
        ("mpirun -np 1 -x SGLANG_OPT_USE_ONLINE_COMPRESS=1", "mpirun"),
        ("numactl --cpunodebind 0 env SGLANG_OPT_USE_ONLINE_COMPRESS=1", "numactl"),
    ],
)
def test_the_environment_a_wrapper_sets_is_the_servers(capsys, wrapper, said):
    rc, out = check(
        capsys,
        f"{wrapper} python3 -m sglang.launch_server {FLASH} --disaggregation-mode prefill --tp 8",
        f"{FLASH} --disaggregation-mode decode --tp 8",
    )
    assert rc == 1, out
    assert f"note: run by {said}" in out
    assert "the environment it sets is read: SGLANG_OPT_USE_ONLINE_COMPRESS)" in out
    assert "- SGLANG_OPT_USE_ONLINE_COMPRESS (online C128): prefill on, decode off" in out


# --- SGLang's --config YAML ---------------------------------------------------------------------------


def test_speculative_settings_kept_in_sglangs_config_yaml(tmp_path, capsys):
    cfg = tmp_path / "decode.yaml"
    cfg.write_text(
        "speculative-algorithm: EAGLE\nspeculative-num-steps: 3\nspeculative-eagle-topk: 1\n"
        "speculative-num-draft-tokens: 4\ntrust-remote-code: true\n"
    )
    decode = f"--model-path deepseek-ai/DeepSeek-V4-Flash --disaggregation-mode decode --tp 8 --config {cfg}"
    rc, out = check(capsys, NV_PREFILL, decode)
    assert rc == 1, out
    assert "c4_ring: 8 vs 16" in out
    assert f"note: --config {cfg} read as SGLang merges it (the command line wins)" in out
    rc, out = check(capsys, f"{NV_PREFILL} {SPEC}", decode)
    assert rc == 0, out


def test_the_command_line_wins_over_the_config_yaml(tmp_path, capsys):
    cfg = tmp_path / "prefill.yml"
    cfg.write_text("kv-cache-dtype: bfloat16\nspeculative-num-steps: 5\n")
    prefill = f"{NV_PREFILL} {SPEC} --config {cfg} --kv-cache-dtype fp8_e4m3"
    rc, out = check(capsys, prefill, f"{NV_DECODE}")
    assert rc == 0, out  # steps 5 from YAML lose to --speculative-num-steps 3; fp8 wins over bfloat16


def test_a_config_that_is_not_yaml_stops_sglang(tmp_path, capsys):
    rc, out = check(capsys, f"{NV_PREFILL} --config {tmp_path}/x.json", NV_DECODE)
    assert rc == 2
    assert "ValueError: Config file must be YAML format, got: .json" in out


# --- recipe files (srt-slurm / Dynamo) ---------------------------------------------------------------

# The recipe's two environments share these lines (the decode's adds three of its own).
_ENV_HEAD = """\
      PYTHONUNBUFFERED: "1"
      SGLANG_RADIX_FORCE_MISS: "1"
      SGLANG_JIT_DEEPGEMM_FAST_WARMUP: "1"
      SGLANG_DEFAULT_THINKING: "1"
      SGLANG_DSV4_REASONING_EFFORT: "max"
      SGLANG_OPT_SWA_SPLIT_LEAF_ON_INSERT: "1"
      SGLANG_OPT_SWA_EVICT_DROP_PAGE_MARGIN: "1"
      SGLANG_OPT_USE_ONLINE_COMPRESS: "1"
      NCCL_MNNVL_ENABLE: "1"
      NCCL_CUMEM_ENABLE: "1"
      SGLANG_MOONCAKE_CUSTOM_MEM_POOL: "True"
"""
_ENV_TAIL = """\
      MC_FORCE_MNNVL: "1"
      SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT: "100000"
      SGLANG_DISAGGREGATION_WAITING_TIMEOUT: "100000"
      SGLANG_OPT_SWA_RELEASE_LEAF_LOCK_AFTER_WINDOW: "1"
      DYN_SKIP_SGLANG_LOG_FORMATTING: "1"
      SGLANG_LOG_FORWARD_ITERS: "1"
      SGLANG_LOG_MS: "1"
      SGLANG_REQUEST_STATE_WAIT_TIMEOUT: "60"
"""
# The srt-slurm recipe of SGLang issue #30242 ("Deepseek V4 NVFP4 Disagg Decode node failure",
# github.com/sgl-project/sglang/issues/30242): DeepSeek-V4-Pro NVFP4, 1 prefill DEP4, 1 decode DEP16.
SRT_SLURM_RECIPE = f"""\
base:
  name: "dsv4-pro-gb300-disagg-1p1d-dep4-dep16-8k1k-nvfp4-trttlm-gen"
  model:
    path: "dsv4-pro-nvfp4"
    container: "dev"
    precision: "fp4"
  backend:
    type: sglang
    prefill_environment:
{_ENV_HEAD}{_ENV_TAIL}    decode_environment:
{_ENV_HEAD}      SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: "8"
{_ENV_TAIL}      SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK: "1024"
      SGLANG_MOE_NVFP4_DISPATCH: "1"
    sglang_config:
      prefill:
        served-model-name: "deepseek-ai/DeepSeek-V4-Pro"
        trust-remote-code: true
        watchdog-timeout: 86400
        skip-tokenizer-init: true
        stream-interval: 60
        tensor-parallel-size: 4
        data-parallel-size: 4
        expert-parallel-size: 4
        enable-dp-attention: true
        moe-a2a-backend: "flashinfer"
        moe-runner-backend: "flashinfer_trtllm_routed"
        moe-dense-tp-size: 1
        disable-flashinfer-autotune: true
        disaggregation-mode: "prefill"
        disaggregation-transfer-backend: mooncake
        mem-fraction-static: 0.90
        max-running-requests: 512
        chunked-prefill-size: 32768
      decode:
        served-model-name: "deepseek-ai/DeepSeek-V4-Pro"
        trust-remote-code: true
        watchdog-timeout: 86400
        skip-tokenizer-init: true
        stream-interval: 60
        load-balance-method: "total_requests"
        moe-a2a-backend: "flashinfer"
        moe-runner-backend: "flashinfer_trtllm_routed"
        disable-flashinfer-autotune: true
        disaggregation-mode: "decode"
        disaggregation-transfer-backend: mooncake
        disaggregation-decode-polling-interval: 8
        mem-fraction-static: 0.85
        swa-full-tokens-ratio: 0.056
        context-length: 9216
        tensor-parallel-size: 16
        data-parallel-size: 16
        expert-parallel-size: 16
        enable-dp-attention: true
        enable-dp-lm-head: true
        moe-dense-tp-size: 1
        max-running-requests: 21504
        cuda-graph-max-bs: 256
override_cutedsl:
  name: "dsv4-pro-gb300-disagg-1p1d-dep4-dep16-8k1k-nvfp4-cutedsl"
"""


def check_recipe(capsys, tmp_path, text: str = SRT_SLURM_RECIPE, *extra: str) -> tuple[int, str]:
    """``check --recipe`` on ``text`` (written to a file); its model alias ``dsv4-pro-nvfp4`` is
    DeepSeek-V4-Pro, built in."""
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return check(capsys, None, None, "--recipe", str(path), *extra)


def test_an_srt_slurm_recipe_pair(tmp_path, capsys, release):
    rc, out = check_recipe(capsys, tmp_path)
    if release == "0.5.23":  # --cuda-graph-max-bs is ambiguous there (-decode / -prefill)
        assert rc == 1
        assert "- the decode: SGLang would not start: sglang serve: error: ambiguous option: --cuda-graph-max-bs" in out
        return
    assert rc == 0, out
    assert out.splitlines()[-1] == "compatible"
    assert "not modelled" not in out and "unknown" not in out
    assert "settings (prefill" in out and "do not affect the state layout (--verbose lists them)" in out
    assert "note: recipe overrides not applied: override_cutedsl" in out
    assert "[61 layers: 30 C4, 31 C128; built-in DeepSeek-V4-Pro layout, recognised from 'dsv4-pro-nvfp4']" in out
    assert len(out.splitlines()) <= 24  # one screen


def test_a_recipe_with_online_c128_on_one_side(tmp_path, capsys):
    text = SRT_SLURM_RECIPE.replace("cuda-graph-max-bs: 256", "cuda-graph-max-bs-decode: 256")
    decode_env = text.index("decode_environment:")
    i = text.index('SGLANG_OPT_USE_ONLINE_COMPRESS: "1"', decode_env)
    text = text[:i] + 'SGLANG_OPT_USE_ONLINE_COMPRESS: "0"' + text[i + len('SGLANG_OPT_USE_ONLINE_COMPRESS: "1"') :]
    rc, out = check_recipe(capsys, tmp_path, text)
    assert rc == 1, out
    assert "- SGLANG_OPT_USE_ONLINE_COMPRESS (online C128): prefill on, decode off" in out


def test_verbose_lists_the_layout_neutral_settings(tmp_path, capsys):
    text = SRT_SLURM_RECIPE.replace("cuda-graph-max-bs: 256", "cuda-graph-max-bs-decode: 256")
    rc, out = check_recipe(capsys, tmp_path, text, "--verbose")
    assert rc == 0, out
    assert "--disable-flashinfer-autotune" in out and "SGLANG_DISAGGREGATION_WAITING_TIMEOUT=100000" in out


# --- the pdstate backend's own refusals -----------------------------------------------------------------

PDSTATE = "--disaggregation-transfer-backend pdstate"


@pytest.mark.parametrize(
    "prefill, decode, said",
    [
        pytest.param(
            f"--tp 4 --pp-size 2 {PDSTATE}",
            f"--tp 4 --pp-size 2 {PDSTATE}",
            [
                "- the decode: SGLang would not start: ValueError from pdstate's KV manager: pdstate's SGLang "
                "backend does not support pipeline parallelism on a decode yet (pp_size=2; a PP prefill is served "
                "into a decode of one stage)"
            ],
            id="pipeline-parallelism-on-a-decode-stops-the-backend",
        ),
        pytest.param(
            f"--tp 4 --pp-size 2 {SPEC} {PDSTATE}",
            f"--tp 4 {SPEC} {PDSTATE}",
            [
                "- the prefill: SGLang would not start: ValueError from pdstate's KV manager: pdstate's SGLang "
                "backend does not move a draft model's KV from a pipeline-parallel prefill yet (pp_size=2)"
            ],
            id="a-pp-prefill-with-a-draft-stops-the-backend",
        ),
        pytest.param(
            f"--tp 8 --attn-cp-size 2 --enable-prefill-cp {PDSTATE}",
            f"--tp 8 {PDSTATE}",
            [
                "- the prefill: SGLang would not start: ValueError from pdstate's KV manager: pdstate's SGLang "
                "backend does not support context parallelism yet (attn_cp_size=2, attn_dcp_size=1)"
            ],
            id="context-parallelism-stops-the-backend",
        ),
    ],
)
def test_the_backends_refusal_is_predicted(capsys, prefill, decode, said):
    rc, out = check(capsys, *flash_pair(prefill, decode))
    assert rc == 1, out
    for line in said:
        assert line in out


TOKENIZER_WORKERS_REFUSED = (
    "- the prefill: SGLang would not start: ValueError from pdstate's KV manager: pdstate's SGLang backend cannot "
    "reach the tokenizer worker processes of an SGLang without SGLANG_HTTP_SERVER_APP_PATH (0.5.19; "
    "tokenizer_worker_num=2): use --tokenizer-worker-num 1, or SGLang 0.5.23"
)


@pytest.mark.parametrize("workers", [1, 2])
def test_several_tokenizer_workers_are_refused_where_sglang_fixes_their_app(capsys, release, workers):
    """0.5.19's tokenizer workers import SGLang's own app (no plugin loader there): pdstate's KV
    manager refuses N > 1 at start; 0.5.23's import the app pdstate's plugin names, and are served."""
    rc, out = check(capsys, *flash_pair(f"--tp 8 --tokenizer-worker-num {workers} {PDSTATE}", f"--tp 8 {PDSTATE}"))
    if release == "0.5.19" and workers > 1:
        assert rc == 1, out
        assert [line for line in out.splitlines() if "tokenizer" in line] == [TOKENIZER_WORKERS_REFUSED], out
        assert "INCOMPATIBLE: 1 problem" in out
    else:
        assert rc == 0, out
        assert out.splitlines()[-1] == "compatible"
        assert "not modelled" not in out and "tokenizer" not in out


def test_a_pp_prefill_without_a_draft_into_a_decode_of_one_stage_works(capsys):
    rc, out = check(capsys, *flash_pair(f"--tp 4 --pp-size 2 {PDSTATE}", f"--tp 4 {PDSTATE}"))
    assert rc == 0, out
    assert out.splitlines()[-1] == "compatible"


def test_a_prefill_attention_tp_wider_than_the_decodes_works(capsys):
    rc, out = check(capsys, *flash_pair(f"--tp 8 {PDSTATE}", f"--tp 8 --dp 8 --enable-dp-attention {PDSTATE}"))
    assert rc == 0, out


def test_a_decode_attention_tp_wider_than_the_prefills_works(capsys):
    rc, out = check(capsys, *flash_pair(f"--tp 8 --dp 8 --enable-dp-attention {PDSTATE}", f"--tp 8 {PDSTATE}"))
    assert rc == 0, out


def test_decode_radix_cache_per_release(capsys, release):
    rc, out = check(
        capsys,
        *flash_pair(f"--tp 8 {SPEC} {PDSTATE}", f"--tp 8 {SPEC} --disaggregation-decode-enable-radix-cache {PDSTATE}"),
    )
    if release == "0.5.19":
        assert rc == 1
        assert (
            "- the decode: SGLang would not start: ValueError: --disaggregation-decode-enable-radix-cache is "
            "incompatible with speculative decoding (--speculative-algorithm EAGLE" in out
        )
    else:  # 0.5.23 keeps a decode radix cache with EAGLE, and pdstate's backend serves it
        assert rc == 0, out


def test_each_backend_refusal_is_the_backends_own_text():
    """The preflight's refusals (``launch.backend``) are the very functions the backend calls (one
    truth): the manager raises and records what they return, and nothing of its own."""
    import ast

    from pdstate.integrations.sglang.launch.backend import (
        context_parallel_refusal,
        pipeline_parallel_refusal,
        tokenizer_workers_refusal,
    )

    manager = (REPO / "src/pdstate/integrations/sglang/manager.py").read_text()
    called = {
        n.func.id for n in ast.walk(ast.parse(manager)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    assert {"context_parallel_refusal", "pipeline_parallel_refusal", "tokenizer_workers_refusal"} <= called
    for phrase in (
        "does not support context parallelism",
        "pipeline parallelism on a decode",
        "pipeline-parallel",
        "cannot reach the tokenizer worker",
        "--tokenizer-worker-num 1",
    ):
        assert phrase not in manager, f"the backend words {phrase!r} itself: call launch/backend.py instead"
    assert tokenizer_workers_refusal(2, app_path_setting=False) == (
        "pdstate's SGLang backend cannot reach the tokenizer worker processes of an SGLang without "
        "SGLANG_HTTP_SERVER_APP_PATH (0.5.19; tokenizer_worker_num=2): use --tokenizer-worker-num 1, or SGLang 0.5.23"
    )
    assert tokenizer_workers_refusal(2, app_path_setting=True) is None  # 0.5.23: the plugin names its app
    assert tokenizer_workers_refusal(1, app_path_setting=False) is None
    assert "context parallelism yet (attn_cp_size=2, attn_dcp_size=1)" in context_parallel_refusal(2, 1)
    assert "pipeline parallelism on a decode yet (pp_size=2;" in pipeline_parallel_refusal(2, "decode")
    assert "draft model's KV from a pipeline-parallel prefill yet (pp_size=2)" in pipeline_parallel_refusal(
        2, "prefill", draft=True
    )
    assert pipeline_parallel_refusal(2, "prefill") is None  # served: into a decode of one stage
    assert context_parallel_refusal(1, 1) is None and pipeline_parallel_refusal(1, "decode", draft=True) is None


# --- models ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "deepseek-ai/DeepSeek-V4-Flash-FP8",
        "nvidia/DeepSeek-V4-Flash-NVFP4",
        "/models/dsv4-flash-0731",
        "deepseek-v4-flash-ga-260731",
    ],
)
def test_flash_variants_are_recognised_by_name(capsys, name):
    rc, out = check(
        capsys,
        f"--model-path {name} --disaggregation-mode prefill",
        f"--model-path {name} --disaggregation-mode decode",
    )
    assert rc == 0, out
    assert "built-in DeepSeek-V4-Flash layout" in out


def test_another_architecture_is_one_clear_line(capsys, tmp_path):
    rc, out = check(
        capsys,
        "--model-path deepseek-ai/DeepSeek-V3 --tp 8 --disaggregation-mode prefill",
        "--model-path deepseek-ai/DeepSeek-V3 --tp 8 --disaggregation-mode decode",
    )
    assert rc == 2
    assert out.strip() == (
        "pdstate check: model 'deepseek-ai/DeepSeek-V3' is not a DeepSeek-V4 model: pdstate models DeepSeek-V4 "
        "state (DeepseekV4ForCausalLM); it does not check other architectures' KV layouts (SGLang's own "
        "bootstrap still compares page size and KV dtype)"
    )
    assert "config.json" not in out
    v3 = model_config(tmp_path, "v3.json", nextn=False, architectures=["DeepseekV3ForCausalLM"])
    rc, out = check(capsys, "--disaggregation-mode prefill", "--disaggregation-mode decode", "--model-config", v3)
    assert rc == 2 and "architecture DeepseekV3ForCausalLM is not a DeepSeek-V4 model" in out


# --- noise, --strict, server info ----------------------------------------------------------------------


def test_layout_neutral_flags_and_variables_are_counted_not_listed(capsys):
    noise = (
        "--disable-flashinfer-autotune --enable-dp-lm-head --deepep-config /cfg/deepep.json --tokenizer-worker-num 4 "
        "--mem-fraction-static 0.8 --host 0.0.0.0 --port 30000"
    )
    env = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=600 GLOO_SOCKET_IFNAME=eth0 NCCL_IB_HCA=mlx5 "
    rc, out = check(capsys, f"{env}{NV_PREFILL} {SPEC} {noise}", f"{env}{NV_DECODE} {noise}")
    assert rc == 0, out
    assert "not modelled" not in out and "unknown" not in out
    assert "22 settings (prefill 11, decode 11) do not affect the state layout (--verbose lists them)" in out


def test_strict_fails_only_on_settings_sglang_does_not_know(capsys):
    rc, out = check(capsys, f"{NV_PREFILL} {SPEC} --enable-hisparse", NV_DECODE, "--strict")
    assert rc == 0, out  # not modelled, but SGLang knows it
    assert out.splitlines()[-1] == "compatible (in what is modelled; see 'not modelled' above)"
    rc, out = check(capsys, f"{NV_PREFILL} {SPEC} --not-a-flag", NV_DECODE, "--strict")
    assert rc == 1
    assert not any(line.startswith("compatible") for line in out.splitlines())


def test_a_server_reporting_auto_kv_cache_dtype(capsys, monkeypatch):
    from pdstate.integrations.sglang.launch import prediction

    info = {
        "model_path": "deepseek-ai/DeepSeek-V4-Flash",
        "page_size": 256,
        "kv_cache_dtype": "auto",
        "disaggregation_mode": "prefill",
        "version": "0.5.23",
    }
    monkeypatch.setattr(prediction, "fetch_server_info", lambda url, timeout: dict(info))
    rc, out = check(
        capsys, "http://prefill:30000", "--model-path deepseek-ai/DeepSeek-V4-Flash --disaggregation-mode decode"
    )
    assert rc == 0, out
    assert "the server reports kv_cache_dtype auto: SGLang runs DeepseekV4ForCausalLM with fp8_e4m3" in out


# --- SGLang's argument tables stay SGLang's ------------------------------------------------------------


def test_the_committed_argument_tables_are_sglangs(release):
    """Regenerate each release's table from its cached SGLang environment and compare."""
    from pdstate.devtools.sglang_args import data_path, extract
    from pdstate.devtools.sglang_pair.pair import env_dir

    if not Path(env_dir(release)).is_dir():
        pytest.skip(f"no cached SGLang {release} environment (make sglang-env)")
    assert extract(release) == data_path(release).read_text()


# --- per-release launch rules --------------------------------------------------------------------------


def test_dspark_with_dp_attention_needs_the_dp_lm_head(capsys):
    dspark = "--speculative-algorithm DSPARK --tp 8 --dp 8 --enable-dp-attention"
    rc, out = check(capsys, *flash_pair(dspark, dspark))
    assert rc == 1
    assert out.count("SGLang would not start: ValueError: DSpark with dp attention requires --enable-dp-lm-head.") == 2
    rc, out = check(capsys, *flash_pair(f"{dspark} --enable-dp-lm-head", f"{dspark} --enable-dp-lm-head"))
    assert "SGLang would not start" not in out
    assert "not modelled: --speculative-algorithm DSPARK" in out


def test_dspark_pipeline_parallelism_is_for_the_prefill_only(capsys, release):
    rc, out = check(
        capsys,
        *flash_pair("--speculative-algorithm DSPARK --tp 4", "--speculative-algorithm DSPARK --tp 4 --pp-size 2"),
    )
    said = "the decode: SGLang would not start: ValueError: DSpark pipeline parallelism requires PD prefill" in out
    assert said == (release == "0.5.23")


def test_a_config_yaml_key_sglang_0_5_23_refuses(tmp_path, capsys, release):
    cfg = tmp_path / "decode.yaml"
    cfg.write_text("enable-dp-attention: true\ndp-size: 8\n")
    rc, out = check(capsys, NV_PREFILL, f"{FLASH} --disaggregation-mode decode --tp 8 --config {cfg}")
    if release == "0.5.19":
        assert rc == 0, out
    else:  # a deprecated switch there: its YAML merger refuses the key
        assert rc == 2
        assert "Unsupported config option 'enable_dp_attention'" in out


def test_dynamos_sglang_worker_reads_sglangs_flags(capsys):
    # Dynamo's SGLang worker takes SGLang's own arguments (python3 -m dynamo.sglang ...).
    rc, out = check(
        capsys,
        f"python3 -m dynamo.sglang {FLASH} --disaggregation-mode prefill --tp 8 {SPEC}",
        f"python3 -m dynamo.sglang {FLASH} --disaggregation-mode decode --tp 8",
    )
    assert rc == 1
    assert "c4_ring: 16 vs 8" in out


POLICY = "--disaggregation-decode-allocation-policy prefill_complete"


def test_a_decode_allocation_policy_on_one_side(capsys, release):
    rc, out = check(capsys, *flash_pair(POLICY, ""))
    if release == "0.5.19":  # no such flag there: unknown to its parser (--strict fails on it)
        assert rc == 0 and f"unknown: {POLICY}" in out, out
        return
    assert rc == 1, out
    lines = out.splitlines()
    assert "- --disaggregation-decode-allocation-policy: prefill prefill_complete, decode early" in lines
    assert (
        "  fix: set `--disaggregation-decode-allocation-policy early` on the prefill (or `prefill_complete` on "
        "the decode): SGLang 0.5.23 wants it identical on both roles"
    ) in lines
    assert lines[-1] == (
        "pdstate's handshake refuses the pair with AllocationPolicyMismatch: Disaggregation decode allocation "
        "policy mismatch: prefill=prefill_complete, decode=early. Set --disaggregation-decode-allocation-policy "
        "identically on both roles."
    )
    rc, out = check(capsys, *flash_pair(POLICY, POLICY))
    assert rc == 0, out
    assert out.splitlines()[-1] == "compatible"


@pytest.mark.parametrize(
    "extra, unsupported",
    [
        ("--tp 8", "attention tensor parallelism greater than one"),
        ("--tp 8 --dp 8 --enable-dp-attention --pp-size 2", "pipeline or attention context parallelism"),
        ("--disaggregation-transfer-backend pdstate", "transfer backends other than Mooncake"),
        ("--enable-hisparse", "HiSparse"),
    ],
)
def test_prefill_complete_refuses_what_it_does_not_support_yet(capsys, release, extra, unsupported):
    rc, out = check(capsys, *flash_pair(f"{POLICY} {extra}", f"{POLICY} {extra}"))
    if release == "0.5.19":  # the flag is SGLang 0.5.23's: 0.5.19's parser does not know it
        assert f"unknown: {POLICY}" in out and "prefill_complete does not yet support" not in out
        return
    assert rc == 1, out
    said = (
        "SGLang would not start: ValueError: --disaggregation-decode-allocation-policy prefill_complete does "
        f"not yet support {unsupported}"
    )
    assert f"- the prefill: {said}" in out and f"- the decode: {said}" in out
