#!/bin/bash
# Source: https://github.com/sgl-project/sglang/blob/01c5c03f29584c6e1105b73de25b7e1799043809/docs_new/src/snippets/configs/deepseek-ai/deepseek-v4.jsx
# (rendered at https://docs.sglang.io/cookbook/autoregressive/DeepSeek/DeepSeek-V4)
# SGLang's DeepSeek-V4 cookbook, the verified cell {hw b200, variant flash, quant fp4, strategy
# balanced, nodes single}: its env and flags as written there, with the cookbook's PD Disaggregation
# card set to the Decode role (its engine, docs_new/src/snippets/_deployment.jsx, inserts
# `--disaggregation-mode decode --disaggregation-transfer-backend mooncake` and the role's
# single-host bootstrap port before the --host/--port tail). {{HOST_IP}}/{{PORT}} filled in.
SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK=1024 sglang serve \
  --trust-remote-code \
  --model-path deepseek-ai/DeepSeek-V4-Flash \
  --tp 4 \
  --dp 4 \
  --enable-dp-attention \
  --moe-a2a-backend deepep \
  --speculative-algorithm EAGLE \
  --speculative-num-steps 1 \
  --speculative-eagle-topk 1 \
  --speculative-num-draft-tokens 2 \
  --deepep-config '{"normal_dispatch":{"num_sms":96},"normal_combine":{"num_sms":96}}' \
  --disaggregation-mode decode \
  --disaggregation-transfer-backend mooncake \
  --disaggregation-bootstrap-port 30435 \
  --host 0.0.0.0 \
  --port 30100
