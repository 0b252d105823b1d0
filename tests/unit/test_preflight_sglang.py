"""``pdstate check --sglang PREFILL DECODE``: SGLang launches predicted and compared with pdstate's
own pool model, one test per mismatch of ``shared/reference/sglang_cpu.md``'s table.

Each mismatch must exit non-zero and name the factor with both values, what SGLang's own backend
does at run time, and the flag to change on which side.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from pdstate.integrations.sglang import releases
from pdstate.integrations.sglang.launch.command import parse_argv, split_launch
from pdstate.integrations.sglang.launch.prediction import predict
from pdstate.pools.presets import DSV4_FLASH_RATIOS
from pdstate.service import preflight
from tests.support.preflight import model_config

SPEC = "--speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
MODEL = "--model-path deepseek-ai/DeepSeek-V4-Flash --trust-remote-code --tp 8"
PREFILL = f"{MODEL} --disaggregation-mode prefill {SPEC}"
DECODE = f"{MODEL} --disaggregation-mode decode --dp 8 --enable-dp-attention {SPEC}"


RELEASES = releases.versions()  # the table's (``pdstate.integrations.sglang.releases``)
_release: list[str] = []  # the release every check() of the running test predicts both sides as


@pytest.fixture(autouse=True, params=RELEASES, ids=lambda r: f"sglang-{r}")
def predicted_release(request):
    """Every test here runs once per SGLang release pdstate models (``--sglang-release``)."""
    _release[:] = [request.param]
    yield request.param
    _release.clear()


def check(capsys, prefill: str, decode: str, *extra: str) -> tuple[int, str]:
    p = argparse.ArgumentParser()
    preflight.configure_check(p)
    if "--sglang-release" not in extra:
        extra = (*extra, "--sglang-release", *_release)
    args = p.parse_args(["--sglang", prefill, decode, *extra])
    rc = args.func(args)
    out = capsys.readouterr()
    return int(rc), out.out + out.err


# --- a compatible pair ---------------------------------------------------------------------------


def test_identical_pair_is_compatible(capsys):
    rc, out = check(capsys, PREFILL, DECODE)
    assert rc == 0, out
    assert out.splitlines()[-1] == "compatible"
    assert "prefill (arguments): deepseek-ai/DeepSeek-V4-Flash [43 layers: 2 SWA-only, 21 C4, 20 C128" in out
    assert "EAGLE (3 steps, 4 draft tokens, 1-layer NextN draft)" in out


def test_tp_dp_and_pool_sizes_do_not_matter(capsys):
    rc, out = check(
        capsys,
        PREFILL + " --mem-fraction-static 0.8 --max-running-requests 64 --chunked-prefill-size 8192",
        DECODE.replace("--tp 8", "--tp-size 16") + " --dp-size 16 --stream-interval 4 --host 0.0.0.0 --port 30001",
    )
    assert rc == 0, out
    assert "not modelled" not in out


def test_non_speculative_pair_is_compatible(capsys):
    rc, out = check(capsys, "--disaggregation-mode prefill", "--disaggregation-mode decode")
    assert rc == 0, out
    assert "not speculative" in out


# --- speculative on one side only (C4 ring 16 vs 8, and a draft on one side only) ----------------


def test_speculative_prefill_non_speculative_decode(capsys):
    rc, out = check(capsys, PREFILL, DECODE.replace(SPEC, ""))
    assert rc == 1
    assert "- --speculative-algorithm: prefill EAGLE (3 steps, 4 draft tokens), decode off" in out
    assert "c4_ring: 16 vs 8 -> C4 state rings 16 vs 8: wrong state; SGLang 0.5.19 reports Success" in out
    assert "c128_ring: 256 vs 128 -> C128 state rings 256 vs 128: wrong state" in out
    assert "draft: 1-layer paged draft, page 256, window 128 vs none -> the prefill sends a draft SWA component" in out
    assert "requests hang until the decode's timeout (300 s by default)" in out
    assert f"fix: add `{SPEC}` to the decode (or remove the --speculative-* flags from the prefill)" in out
    assert "pdstate's handshake refuses the pair with LayoutMismatch: DSV4 layout mismatch on c4_ring" in out


def test_speculative_decode_only_leaves_the_draft_stale(capsys):
    rc, out = check(capsys, PREFILL.replace(SPEC, ""), DECODE)
    assert rc == 1
    assert "c4_ring: 8 vs 16" in out
    assert (
        "draft: none vs 1-layer paged draft, page 256, window 128 -> SGLang reports Success, but the decode's draft"
        in out
    )
    assert "stale state" in out
    assert f"fix: add `{SPEC}` to the prefill (or remove the --speculative-* flags from the decode)" in out


def test_other_step_counts_do_not_change_a_paged_layout(capsys):
    other = SPEC.replace("--speculative-num-steps 3", "--speculative-num-steps 5").replace("tokens 4", "tokens 6")
    rc, out = check(capsys, PREFILL, DECODE.replace(SPEC, other))
    assert rc == 0, out
    assert "same layout although --speculative-num-steps (draft tokens): prefill EAGLE (3 steps, 4 draft tokens)" in out


# --- the same layers in another order (via --model-config) ----------------------------------------


def test_same_layers_in_another_order(tmp_path, capsys):
    flash = model_config(tmp_path, "flash.json")
    swapped = model_config(tmp_path, "swapped.json", compress_ratios=[0, 0] + [128, 4] * 20 + [4, 0])
    rc, out = check(capsys, PREFILL, DECODE, "--model-config", flash, "--model-config", swapped)
    assert rc == 1
    assert "- compress_ratios / num_hidden_layers (the model's config.json)" in out
    assert "compression_ratios: DeepSeek-V4-Flash (43 layers: 2 SWA-only, 21 C4, 20 C128) vs 43 layers:" in out
    assert "same C4/C128 counts in another order: SGLang reports Success" in out
    assert "640 of 750" in out
    assert (
        f"fix: serve the same model on both sides (its config.json compress_ratios and num_hidden_layers): prefill config {flash}, decode config {swapped}"
        in out
    )
    assert "the same layers in another order (first at layer 2: 4 vs 128)" in out  # the handshake's refusal


def test_different_layer_counts_kill_the_prefill_queue(tmp_path, capsys):
    fewer = model_config(
        tmp_path, "fewer.json", num_hidden_layers=41, compress_ratios=list(DSV4_FLASH_RATIOS[:41]) + [0]
    )
    rc, out = check(
        capsys, PREFILL, DECODE, "--model-config", model_config(tmp_path, "f.json"), "--model-config", fewer
    )
    assert rc == 1
    assert "different C4/C128 counts: SGLang's prefill transfer thread dies" in out


# --- sliding window 256 or 64 vs 128 ----------------------------------------------------------------


@pytest.mark.parametrize("window", [256, 64])
def test_sliding_window_override_on_one_side(capsys, window):
    override = f"--json-model-override-args '{{\"sliding_window\": {window}}}'"
    rc, out = check(capsys, PREFILL, f"{DECODE} {override}")
    assert rc == 1
    assert (
        f"sliding_window: 128 vs {window} -> sliding window 128 vs {window}: SGLang reports Success (a log warning only)"
        in out
    )
    assert "every SWA entry lands one page off" in out
    assert 'fix: remove "sliding_window" from --json-model-override-args on the decode' in out


def test_sliding_window_from_the_model_config(tmp_path, capsys):
    wide = model_config(tmp_path, "wide.json", sliding_window=256)
    rc, out = check(capsys, PREFILL, DECODE, "--model-config", model_config(tmp_path, "f.json"), "--model-config", wide)
    assert rc == 1
    assert "sliding_window: 128 vs 256" in out
    assert (
        f"fix: serve one model config on both sides: sliding_window 128 (config {tmp_path}/f.json) vs 256 (config {wide})"
        in out
    )


# --- page size ------------------------------------------------------------------------------------------


def test_page_size_flag_is_overridden_for_dsv4(capsys, predicted_release):
    rc, out = check(capsys, PREFILL, DECODE + " --page-size 64")
    assert rc == 0, out
    assert (
        f"note: --page-size 64 is overridden: SGLang {predicted_release} runs DeepseekV4ForCausalLM with page_size "
        "256 on CUDA" in out
    )


def test_page_size_of_running_servers_differs(sglang_server, capsys):
    p = sglang_server(server_info("prefill"))
    d = sglang_server(server_info("decode", page_size=512))
    rc, out = check(capsys, p, d)
    assert rc == 1
    assert "- --page-size: prefill 256, decode 512" in out
    assert "page_size: 256 vs 512 -> SGLang's decode refuses the bootstrap (\"Page size mismatch" in out
    assert "the prefill waits in Bootstrapping until its timeout" in out
    assert "fix: run both sides with one page size (--page-size" in out
    assert (
        "pdstate's handshake refuses the pair with PageSizeMismatch: Page size mismatch: prefill server has page_size=256"
        in out
    )


# --- KV cache dtype -------------------------------------------------------------------------------------


def test_kv_cache_dtype_differs(capsys):
    rc, out = check(capsys, PREFILL + " --kv-cache-dtype fp8_e4m3", DECODE + " --kv-cache-dtype bfloat16")
    assert rc == 1
    assert "- --kv-cache-dtype: prefill fp8_e4m3, decode bfloat16" in out
    assert (
        'kv_dtype: float8_e4m3fn vs bfloat16 -> SGLang\'s decode refuses the bootstrap ("KV cache dtype mismatch"'
        in out
    )
    assert "fix: set `--kv-cache-dtype fp8_e4m3` (or auto) on the decode (it has bfloat16)" in out
    assert "SGLang would not start: --kv-cache-dtype bfloat16: the paged DSV4 KV pool stores fp8 only" in out
    assert "KVCacheDtypeMismatch: KV cache dtype mismatch" in out


def test_auto_kv_cache_dtype_is_fp8_e4m3(capsys):
    rc, out = check(capsys, PREFILL + " --kv-cache-dtype auto", DECODE + " --kv-cache-dtype=fp8_e4m3")
    assert rc == 0, out


# --- environment: online C128, state dtype --------------------------------------------------------------


def test_online_c128_on_one_side(capsys):
    env = "SGLANG_OPT_USE_ONLINE_COMPRESS=1 SGLANG_EXPERIMENTAL_ONLINE_C128_MTP=1"
    rc, out = check(capsys, f"{env} {PREFILL}", DECODE)
    assert rc == 1
    assert "- SGLANG_OPT_USE_ONLINE_COMPRESS (online C128): prefill on, decode off" in out
    assert "c128_ring: 1 vs 256 -> C128 state ring 1 vs 256 (online vs offline): wrong C128 state" in out
    assert (
        "fix: set SGLANG_OPT_USE_ONLINE_COMPRESS=1 on the decode too with SGLANG_EXPERIMENTAL_ONLINE_C128_MTP=1 "
        "(or unset it on the prefill)"
    ) in out


def test_online_c128_with_mtp_needs_the_option(capsys):
    rc, out = check(capsys, f"SGLANG_OPT_USE_ONLINE_COMPRESS=1 {PREFILL}", f"SGLANG_OPT_USE_ONLINE_COMPRESS=1 {DECODE}")
    assert rc == 1
    assert out.count("SGLang would not start: AssertionError: online c128 does not support MTP") == 2


def test_state_dtype_differs(capsys):
    rc, out = check(capsys, PREFILL, f"SGLANG_DSV4_COMPRESS_STATE_DTYPE=bf16 {DECODE}")
    assert rc == 1
    assert "c4_state_dtype: float32 vs bfloat16 -> compressor state in float32 vs bfloat16" in out
    assert "fix: set SGLANG_DSV4_COMPRESS_STATE_DTYPE to one value on both sides" in out


# --- what SGLang itself would refuse, and the pair outside the layout --------------------------------


def test_nextn_and_missing_topk_stop_sglang(capsys):
    rc, out = check(capsys, f"{MODEL} --disaggregation-mode prefill --speculative-algorithm NEXTN", DECODE)
    assert rc == 1
    assert "INCOMPATIBLE: 2 problems" in out  # the two asserts; the layouts agree (EAGLE, 4 draft tokens, both)
    assert "- the prefill: SGLang would not start: AssertionError: Only EAGLE and DSPARK speculative algorithms" in out
    assert "(--speculative-eagle-topk None: write --speculative-eagle-topk 1)" in out
    assert "- --speculative-algorithm" not in out


def test_disaggregation_mode_and_backend(capsys):
    rc, out = check(capsys, MODEL + " " + SPEC, DECODE + " --disaggregation-transfer-backend nixl")
    assert rc == 1
    assert "- the prefill side has --disaggregation-mode null (not a PD server)" in out
    assert "fix: add `--disaggregation-mode prefill` to the prefill" in out
    assert "--disaggregation-transfer-backend: prefill mooncake, decode nixl" in out


# --- arguments it does not model ------------------------------------------------------------------------


def test_unmodelled_arguments_are_listed_not_guessed(capsys, predicted_release):
    rc, out = check(capsys, PREFILL + " --enable-hisparse --some-new-flag 7", DECODE + " --pp-size 2")
    assert rc == 0, out
    assert f"  unknown: --some-new-flag 7 (SGLang {predicted_release}'s parser does not know it" in out
    assert "  not modelled: --enable-hisparse (HiSparse swaps the C4 pool)" in out
    assert "  not modelled: --pp-size 2" in out
    assert out.splitlines()[-1] == "compatible (in what is modelled; see 'not modelled' above)"
    rc, out = check(capsys, PREFILL + " --some-new-flag 7", DECODE, "--strict")
    assert rc == 1
    assert "compatible" not in out.splitlines()[-1]
    assert out.splitlines()[-1] == "not confirmed (--strict): 1 setting unknown to SGLang's parser above"


def test_unknown_model_needs_its_config(tmp_path, capsys):
    rc, out = check(capsys, "--model-path acme/Other --disaggregation-mode prefill", DECODE)
    assert rc == 2
    assert "cannot tell the layer layout of model 'acme/Other': give its config.json with --model-config PATH" in out
    rc, out = check(
        capsys,
        "--model-path acme/Other --disaggregation-mode prefill",
        DECODE,
        "--model-config",
        model_config(tmp_path, "m.json"),
    )
    assert rc == 1  # speculative only on the decode
    assert "acme/Other" in out


def test_model_path_directory_config_is_read(tmp_path, capsys):
    d = tmp_path / "model"
    d.mkdir()
    model_config(d, "config.json", sliding_window=64)
    rc, out = check(capsys, PREFILL, f"--model-path {d} --disaggregation-mode decode {SPEC}")
    assert rc == 1
    assert "sliding_window: 128 vs 64" in out


# --- @file and http:// inputs ------------------------------------------------------------------------


def test_at_file_reads_a_launch_script(tmp_path, capsys):
    script = tmp_path / "prefill.sh"
    script.write_text(
        "# prefill of the DSV4 pair\n"
        "SGLANG_DSV4_COMPRESS_STATE_DTYPE=float32 python3 -m sglang.launch_server \\\n"
        f"  {MODEL} \\\n"
        "  --disaggregation-mode prefill \\\n"
        f"  {SPEC}\n"
    )
    rc, out = check(capsys, f"@{script}", DECODE)
    assert rc == 0, out
    assert f"prefill (@{script}):" in out
    assert "unknown" not in out and "python3" not in out


def test_at_file_missing(tmp_path, capsys):
    rc, out = check(capsys, f"@{tmp_path}/nope.sh", DECODE)
    assert rc == 2 and "nope.sh" in out


def server_info(mode: str, **changes) -> dict:
    """What SGLang 0.5.19's /get_server_info reports (resolved ServerArgs fields, and more)."""
    return {
        "model_path": "deepseek-ai/DeepSeek-V4-Flash",
        "page_size": 256,
        "kv_cache_dtype": "fp8_e4m3",
        "speculative_algorithm": "EAGLE",
        "speculative_num_steps": 3,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 4,
        "disaggregation_mode": mode,
        "disaggregation_transfer_backend": "mooncake",
        "tp_size": 8,
        "dp_size": 1,
        "enable_dp_attention": False,
        "pp_size": 1,
        "json_model_override_args": "{}",
        "device": "cuda",
        "enable_hisparse": False,
        "attention_backend": "dsv4",
        "version": "0.5.19",
        "internal_states": [{}],
        **changes,
    }


@pytest.fixture
def sglang_server():
    servers = []

    def start(info: dict, path: str = "/get_server_info") -> str:
        body = json.dumps(info).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path != path:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        srv = HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def test_http_running_servers_compatible(sglang_server, capsys):
    p = sglang_server(server_info("prefill"))
    d = sglang_server(server_info("decode", dp_size=8, enable_dp_attention=True), path="/server_info")
    rc, out = check(capsys, p, d)
    assert rc == 0, out
    assert f"prefill ({p}):" in out
    assert "note: from a running server's /get_server_info" in out


def test_http_running_servers_speculative_mismatch(sglang_server, capsys):
    p = sglang_server(server_info("prefill"))
    d = sglang_server(
        server_info(
            "decode",
            speculative_algorithm=None,
            speculative_num_steps=None,
            speculative_eagle_topk=None,
            speculative_num_draft_tokens=None,
        )
    )
    rc, out = check(capsys, p, f"SGLANG_DSV4_COMPRESS_STATE_DTYPE=float32 {d}")
    assert rc == 1
    assert "c4_ring: 16 vs 8" in out
    assert f"fix: add `{SPEC}` to the decode" in out


def test_http_a_server_reporting_auto_kv_cache_dtype(sglang_server, capsys):
    """SGLang's /get_server_info keeps ``kv_cache_dtype: "auto"`` as given: the check reads it as
    the fp8_e4m3 that SGLang runs DSV4 with, and goes on."""
    p = sglang_server(server_info("prefill", kv_cache_dtype="auto"))
    rc, out = check(capsys, p, DECODE)
    assert rc == 0, out
    assert "note: the server reports kv_cache_dtype auto: SGLang runs DeepseekV4ForCausalLM with fp8_e4m3" in out
    assert out.splitlines()[-1].startswith("compatible")


def test_http_unreachable(capsys):
    rc, out = check(capsys, "http://127.0.0.1:9", DECODE, "--timeout", "1")
    assert rc == 2 and "GET http://127.0.0.1:9/get_server_info" in out


# --- parsing --------------------------------------------------------------------------------------------


def test_split_launch_env_launcher_and_arguments():
    env, argv, launcher = split_launch("env A=1 B='x y' python -m sglang.launch_server --tp 2 # comment\n")
    assert env == {"A": "1", "B": "x y"} and launcher == "python -m sglang.launch_server" and argv == ["--tp", "2"]


def test_parse_argv_forms(predicted_release):
    parsed = parse_argv(
        ["--tp=4", "--dp", "2", "--enable-dp-attention", "--x", "--y", "v", "--host", "h", "--trust-remote-code"],
        predicted_release,
    )
    assert {k: parsed.values[k] for k in ("tp_size", "dp_size", "enable_dp_attention")} == {
        "tp_size": 4,
        "dp_size": 2,
        "enable_dp_attention": True,
    }
    assert parsed.given["tp_size"] == "--tp-size 4"  # SGLang's parser takes the unique prefix
    assert parsed.unknown == ["--x", "--y v"] and parsed.values["host"] == "h" and parsed.error is None


def test_predict_resolves_speculative_defaults():
    side = predict(
        "decode",
        "--speculative-algorithm EAGLE --speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 8",
    )
    assert side.speculative_num_draft_tokens == 3
    assert any("adjusted to 3" in n for n in side.notes)
    assert side.pool_settings().speculative_num_draft_tokens == 3


# --- a pair on two releases (a rolling upgrade) ----------------------------------------------------

UNIFIED = "SGLANG_HACK_FLASHMLA_BACKEND=unified_kv_triton "


def test_paged_sides_on_two_releases_are_compatible(capsys):
    rc, out = check(capsys, PREFILL, DECODE, "--sglang-release", "0.5.19", "--sglang-release", "0.5.23")
    assert rc == 0, out
    assert "SGLang 0.5.19 (--sglang-version)" in out and "SGLang 0.5.23 (--sglang-version)" in out
    assert out.splitlines()[-1] == "compatible"


def test_unified_sides_on_two_releases_address_c4_state_differently(capsys):
    rc, out = check(
        capsys, UNIFIED + PREFILL, UNIFIED + DECODE, "--sglang-release", "0.5.19", "--sglang-release", "0.5.23"
    )
    assert rc == 1, out
    assert "c4_ring" in out
    rc, out = check(capsys, UNIFIED + PREFILL, UNIFIED + DECODE, "--sglang-release", "0.5.23")
    assert rc == 0, out


def test_an_unknown_release_is_refused_in_one_line(capsys):
    rc, out = check(capsys, PREFILL, DECODE, "--sglang-release", "0.5.20")
    assert rc == 2
    assert out.strip() == "pdstate check: --sglang-version 0.5.20: pdstate models SGLang 0.5.19 and 0.5.23"


def test_the_preflight_models_the_releases_the_pools_build():
    from pdstate.pools.dsv4 import UPSTREAM_RELEASES

    assert {releases.row(r).pools for r in RELEASES} == set(UPSTREAM_RELEASES)


def test_a_running_server_says_its_own_release(sglang_server):
    from pdstate.integrations.sglang.launch.prediction import predict

    old = predict("prefill", sglang_server(server_info("prefill", version="0.5.19")))
    assert (old.release, old.release_source) == ("0.5.19", "the server's /get_server_info")
    assert old.pool_settings().upstream == "0.5.19"
    other = predict("decode", sglang_server(server_info("decode", version="0.6.0")))
    assert other.release == "0.5.23"
    assert "the server runs SGLang 0.6.0, which pdstate does not model; predicted as 0.5.23" in other.notes
    assert predict("decode", sglang_server(server_info("decode")), release="0.5.19").release == "0.5.19"
