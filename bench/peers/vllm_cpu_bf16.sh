#!/usr/bin/env bash
# vLLM's CPU build in bfloat16, its default precision on a CPU with AVX512-BF16; otherwise as vllm_cpu.sh
# serves it (install with `vllm_cpu.sh install DIR` first):  vllm_cpu_bf16.sh DIR PORT [BLOCKS]
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 DIR PORT [BLOCKS]" >&2; exit 2; }
DTYPE=bfloat16 exec "$(dirname "$0")/vllm_cpu.sh" serve "$@"
