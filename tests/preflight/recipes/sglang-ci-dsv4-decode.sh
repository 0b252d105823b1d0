#!/bin/bash
# Source: https://github.com/sgl-project/sglang/blob/01282fb0e85cd207f0e849f2a34d211c2183a8e6/test/registered/disaggregation/test_disaggregation_dsv4.py
# SGLang's own CI pair for DeepSeek-V4-Flash PD (TestDisaggregationDSV4.start_decode), as its
# fixture runs it: popen_launch_pd_server(model, url, other_args=decode_args, env=DSV4_FLASH_ENV)
# is `python3 -m sglang.launch_server --model-path MODEL *other_args --host H --port P`, and the
# fixture adds `--disaggregation-transfer-backend mooncake --disaggregation-ib-device DEVICES` in CI.
# Bootstrap port, host, port and IB devices are the fixture's run-time values (placeholders here).
export SGLANG_DSV4_FP4_EXPERTS=0
export SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK=256
python3 -m sglang.launch_server --model-path sgl-project/DeepSeek-V4-Flash-FP8 \
  --trust-remote-code \
  --disaggregation-mode decode \
  --disaggregation-bootstrap-port 8998 \
  --tp 4 \
  --dp 4 \
  --enable-dp-attention \
  --base-gpu-id 4 \
  --moe-a2a-backend deepep \
  --deepep-config '{"normal_dispatch":{"num_sms":96},"normal_combine":{"num_sms":96}}' \
  --cuda-graph-max-bs 128 \
  --max-running-requests 128 \
  --speculative-algorithm EAGLE \
  --speculative-num-steps 1 \
  --speculative-eagle-topk 1 \
  --speculative-num-draft-tokens 2 \
  --watchdog-timeout 900 \
  --disaggregation-transfer-backend mooncake \
  --disaggregation-ib-device mlx5_0 \
  --host 127.0.0.1 \
  --port 8200
