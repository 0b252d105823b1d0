"""What ``pdstate check --sglang`` models, ignores as layout-neutral, or lists as not modelled:
SGLang's ServerArgs fields and environment variables, sorted into the three kinds."""

from __future__ import annotations

import re

from pdstate.protocol.factors import launch_fields

# ServerArgs fields the prediction reads (SGLang's ``dest`` names; its parser gives the flags).
MODELLED = (
    frozenset(
        """model_path page_size kv_cache_dtype speculative_algorithm speculative_num_steps speculative_eagle_topk
    speculative_num_draft_tokens speculative_draft_model_path speculative_draft_kv_cache_dtype disaggregation_mode
    disaggregation_transfer_backend tp_size dp_size enable_dp_attention attn_dp_size pp_size attn_cp_size dcp_size
    json_model_override_args device attention_backend enable_hisparse enable_deepseek_v4_fp4_indexer enable_prefill_cp
    disaggregation_decode_enable_radix_cache disaggregation_decode_allocation_policy config""".split()
    )
    | launch_fields()
)  # and each layout factor a launch setting sets (``protocol.factors``)
# Layout-neutral fields that SGLang's start-time rules, pdstate's backend (``launch.backend``) or the
# model's name read (counted as neutral, passed to the rules).
RULE_INPUTS = frozenset(
    """enable_dp_lm_head served_model_name enable_pdmux decoupled_spec_role enable_pd_role_switch encoder_only
    language_only enable_hierarchical_cache disaggregation_decode_host_receive_threshold tokenizer_worker_num""".split()
)
# Fields whose names say they may touch the DSV4 state layout: listed as "not modelled" when given,
# unless NEUTRAL below says otherwise. Every other field SGLang knows sizes pools, picks kernels,
# serves HTTP or logs: counted as layout-neutral.
_LAYOUT_HINT = re.compile(
    r"kv_cache|kv_layout|dsv4|dsa_|nsa_|hisparse|c128|compress|indexer|swa|draft|eagle|dspark|speculative|"
    r"page_major|kv_canary|linker|sharding|prefill_cp|context_parallel|cp_strategy|cp_mode|revision|kv_layer"
)
NEUTRAL = frozenset(
    """swa_full_tokens_ratio speculative_accept_threshold_acc speculative_accept_threshold_single
    speculative_moe_a2a_backend speculative_moe_runner_backend speculative_draft_load_format
    speculative_draft_model_quantization speculative_attention_mode speculative_skip_dp_mlp_sync
    speculative_use_rejection_sampling speculative_adaptive speculative_adaptive_config
    speculative_enable_w4a4_mxfp4_megamoe speculative_draft_attention_backend speculative_dsa_topk_backend
    enable_draft_weights_cpu_backup kv_canary_sweep_interval kv_canary_real_data disable_hybrid_swa_memory
    dsv4_prefill_backend enable_decoder_swa_bounded_replay enable_encoder_swa_bounded_replay""".split()
)
# Environment variables the prediction reads.
MODELLED_ENV = (
    "SGLANG_OPT_USE_ONLINE_COMPRESS",
    "SGLANG_EXPERIMENTAL_ONLINE_C128_MTP",
    "SGLANG_DSV4_COMPRESS_STATE_DTYPE",
    "SGLANG_HACK_FLASHMLA_BACKEND",
)
# Variables SGLang reads that do not touch the layout: transport, timeouts, logging, kernels, MoE,
# scheduling. Anything not SGLang's (no SGLANG_/SGL_ prefix) is not read by SGLang for the layout.
NEUTRAL_ENV_PREFIXES = (
    "SGLANG_DISAGGREGATION_",
    "SGLANG_LOG",
    "SGLANG_TORCH_PROFILER",
    "SGLANG_PROFILE",
    "SGLANG_DUMPER",
    "SGLANG_EXPERT_DISTRIBUTION",
    "SGLANG_MOONCAKE_",
    "SGLANG_DEEPEP_",
    "SGLANG_FLASHINFER_",
    "SGLANG_JIT_DEEPGEMM",
    "SGLANG_ENABLE_JIT_DEEPGEMM",
    "SGLANG_MOE_",
    "SGLANG_NCCL",
    "SGLANG_OPT_SWA_",  # radix-tree eviction of SWA pages: which pages live, not how they are laid out
    "SGLANG_OPT_DEEPGEMM_",  # DeepGEMM MoE kernels (MegaMoE token budget, FP4 activations)
    "SGLANG_RADIX_",  # prefix reuse in the radix cache: which pages are reused, not their layout
    "SGL_DG_",
    "SGL_JIT_",
    "SGL_ENABLE_JIT_DEEPGEMM",
)
NEUTRAL_ENV = frozenset(
    """SGLANG_HOST_IP SGLANG_LOCAL_IP_NIC SGLANG_PORT SGLANG_USE_MESSAGE_QUEUE_BROADCASTER SGLANG_SET_CPU_AFFINITY
    SGLANG_REQUEST_STATE_WAIT_TIMEOUT SGLANG_DEFAULT_THINKING SGLANG_DSV4_REASONING_EFFORT
    SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION SGLANG_RADIX_FORCE_MISS SGLANG_HACK_SEQ_BOOTSTRAP_ROOM
    SGLANG_NVFP4_CKPT_FP8_GEMM_IN_ATTN SGLANG_PER_TOKEN_GROUP_QUANT_8BIT_V2 SGLANG_ENABLE_SPEC_V2
    SGLANG_ENABLE_OVERLAP_PLAN_STREAM SGLANG_PLUGINS SGLANG_WATCHDOG_TIMEOUT
    SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK SGLANG_DSV4_FP4_EXPERTS SGLANG_DISAGG_STAGING_BUFFER SGLANG_RUST_SERVER""".split()
)
# Keys of --json-model-override-args / config.json the prediction reads.
CONFIG_KEYS = (
    "compress_ratios",
    "num_hidden_layers",
    "sliding_window",
    "head_dim",
    "qk_rope_head_dim",
    "index_head_dim",
)


def field_kind(dest: str) -> str:
    """``"modelled"``, ``"neutral"`` or ``"not modelled"`` for one of SGLang's ServerArgs fields."""
    if dest in MODELLED or dest in launch_fields():  # a launch setting that is a layout factor
        return "modelled"
    if dest in NEUTRAL or not _LAYOUT_HINT.search(dest):
        return "neutral"
    return "not modelled"


def env_kind(name: str) -> str:
    """``"modelled"``, ``"neutral"`` or ``"not modelled"`` for one environment variable."""
    if name in MODELLED_ENV:
        return "modelled"
    if not name.startswith(("SGLANG_", "SGL_")) or name in NEUTRAL_ENV or name.startswith(NEUTRAL_ENV_PREFIXES):
        return "neutral"
    return "not modelled"
