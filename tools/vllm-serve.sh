#!/usr/bin/env bash
# Serve the converted model with the vLLM `make vllm` installed (tools/vllm-setup.sh).
#   tools/vllm-serve.sh [PORT] [BLOCKS]   (defaults 8100, 45 blocks of 128 tokens = 5,760 tokens)
# VLLM_TARGET_DEVICE=cpu: it cannot tell the platform from this install's version string.
# One torch thread per core left to it; no pinning (VLLM_CPU_OMP_THREADS_BIND=nobind): the
# tests run Envoy and clients beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${1:-8100}
BLOCKS=${2:-45}
BLOCK=128
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} \
  VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind} VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
exec .vllm/bin/vllm serve models/smollm2-hf --served-model-name smollm2 --dtype bfloat16 \
  --host 127.0.0.1 --port "$PORT" --max-model-len $((BLOCKS * BLOCK - BLOCK)) \
  --num-gpu-blocks-override "$BLOCKS" --block-size $BLOCK "${@:3}"
