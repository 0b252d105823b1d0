#!/bin/bash
# Source: https://github.com/ai-dynamo/dynamo/blob/0a3b3f5a786cde8b7ab30f27e7830e7dc6600443/recipes/deepseek-v4.1-flash/sglang/disagg-gb200/deploy-generic.yaml
# The DecodeWorker container of Dynamo's DeepSeek-V4.1-Flash disaggregated SGLang recipe: its env
# entries and its command + args (Dynamo's SGLang worker, a wrapper with its own --dyn-* flags),
# written as one shell launch; the --config path is this directory's copy of the ConfigMap's file.
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export HF_HOME=/shared-model-cache
export SGLANG_JIT_DEEPGEMM_PRECOMPILE=0
export SGLANG_JIT_DEEPGEMM_FAST_WARMUP=1
export SGLANG_DEFAULT_THINKING=true
export NCCL_MNNVL_ENABLE=1
export NCCL_NVLS_ENABLE=1
export NCCL_CUMEM_ENABLE=1
export NCCL_STORE_TIMEOUT=7200
export TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=1800
export DYN_FORWARDPASS_METRIC_PORT=
python3 -m dynamo.sglang --config dynamo-dsv41-flash-decode.yaml --dyn-reasoning-parser deepseek_v41 \
  --dyn-tool-call-parser deepseek_v41 --dyn-enable-structural-tag --prefill-round-robin-balance
