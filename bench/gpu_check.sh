#!/usr/bin/env bash
# DuplexKV on a GPU machine: the CUDA transfer tests, then the KV transfer benchmark
# (pinned-copy baseline, H2D / D2H / both per mode and per copy implementation), table last.
#
#   bash bench/gpu_check.sh          # from anywhere; about 3 minutes, under 5
#
# Needs a python with a CUDA build of torch (found, or installed when a registry answers).
# Results: JSON and logs in $OUT when set, else bench/results/.
# GPU_CHECK_ALLOW_CPU=1 accepts a CPU torch and GPU_CHECK_GIB sets the volume: a dry run of
# this script's own flow on a machine without a GPU.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
DEST="${OUT:-bench/results}"
mkdir -p "$DEST"
LOG="$DEST/gpu_check.log"
: >"$LOG"
say() { echo "[gpu_check] $*" | tee -a "$LOG"; }
STARTED=$SECONDS
BUDGET=285  # seconds for everything; each stage gets what is left
left() { echo $((BUDGET - (SECONDS - STARTED))); }
GIB="${GPU_CHECK_GIB:-1}"

# ---------------------------------------------------------------- a python with CUDA torch
cuda_torch() {
  "$1" -c 'import os, sys, torch; sys.exit(0 if torch.cuda.is_available() or os.environ.get("GPU_CHECK_ALLOW_CPU") else 1)' >/dev/null 2>&1
}
PY=""
for cand in "${PYTHON:-}" python3 /opt/torch/.venv/bin/python3 python; do
  [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 || continue
  if cuda_torch "$cand"; then PY="$(command -v "$cand")"; break; fi
done
if [ -z "$PY" ]; then
  say "no python with a CUDA torch; trying a fresh venv with pip install torch"
  if python3 -m venv --system-site-packages .venv-gpu >>"$LOG" 2>&1 &&
    timeout 150 .venv-gpu/bin/pip install -q --timeout 15 --retries 1 torch numpy pytest >>"$LOG" 2>&1 &&
    cuda_torch .venv-gpu/bin/python; then
    PY=.venv-gpu/bin/python
  else
    say "FAILED: no CUDA-enabled torch and none installable here (see $LOG)"
    nvidia-smi -L 2>&1 | tee -a "$LOG"
    exit 1
  fi
fi
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import platform, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU dry run)"
print(f"[gpu_check] python {platform.python_version()} torch {torch.__version__} cuda {torch.version.cuda} device {gpu}")
EOF
CUDA_MAJOR="$("$PY" -c 'import torch; print((torch.version.cuda or "").split(".")[0])' 2>/dev/null)"
for mod in pytest numpy cupy; do
  "$PY" -c "import $mod" >/dev/null 2>&1 && continue
  pkg=$mod; [ "$mod" = cupy ] && pkg="cupy-cuda${CUDA_MAJOR}x"
  if [ -n "${GPU_CHECK_ALLOW_CPU:-}" ] || [ -z "$CUDA_MAJOR" ]; then
    say "missing python module $mod (dry run: not installing)"
    continue
  fi
  say "missing python module $mod: trying pip install $pkg"
  timeout 30 "$PY" -m pip install -q --timeout 15 --retries 1 "$pkg" >>"$LOG" 2>&1 || say "  could not install $pkg (tests that need it skip)"
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# ---------------------------------------------------------------- tests (CPU and CUDA cases)
say "tests: tests/worker/test_transfer.py tests/worker/test_transfer_sim.py"
timeout 120 "$PY" -m pytest tests/worker/test_transfer.py tests/worker/test_transfer_sim.py \
  -q -rs --noconftest -p no:cacheprovider >"$DEST/pytest.log" 2>&1
TEST_RC=$?
tail -n 30 "$DEST/pytest.log" | tee -a "$LOG"
TEST_LINE="$(grep -E '(passed|failed|error)' "$DEST/pytest.log" | tail -n 1)"

# ---------------------------------------------------------------- benchmark
declare -a BENCH_STATUS=()
bench() {
  local name=$1; shift
  if [ "$(left)" -lt 25 ]; then BENCH_STATUS+=("$name skipped(time)"); say "skip $name: out of time"; return; fi
  say "bench kv $name: $* (${GIB} GiB each way)"
  rm -f "$DEST/kv_$name.json"  # a failed run must not leave an old table row behind
  timeout "$(($(left) - 15))" "$PY" -m bench.micro.kv --gib "$GIB" --json "$DEST/kv_$name.json" "$@" >>"$LOG" 2>&1
  local rc=$?
  BENCH_STATUS+=("$name rc=$rc")
  [ $rc -eq 0 ] || say "  bench $name failed (rc=$rc); see $LOG"
}
bench smollm2 --model smollm2
bench smollm2_per_block --model smollm2 --copy per_block --modes batched,duplex
bench smollm2_cupy --model smollm2 --copy cupy --modes batched,duplex
bench llama3-8b --model llama3-8b
bench qwen2.5-32b --model qwen2.5-32b

# ---------------------------------------------------------------- the table, last
say "done in $((SECONDS - STARTED)) s; tests rc=$TEST_RC; ${BENCH_STATUS[*]}"
"$PY" - "$DEST" "$TEST_LINE" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
dest, test_line = Path(sys.argv[1]), sys.argv[2]
print(f"\n== DuplexKV GPU check ==  tests: {test_line.strip('= ') or 'no result'}")
for path in sorted(dest.glob("kv_*.json")):
    r = json.loads(path.read_text())
    p = r.get("pinned", {})
    print(f"\n{path.stem}: {r['device']}, {r['block_bytes']} B blocks, {r['gib_each_way']} GiB each way (GB/s, median of {r['reps']})")
    if p:
        print(f"  {'pinned contiguous':<24} h2d {p['h2d_gbps']:>7}  d2h {p['d2h_gbps']:>7}  both {p['duplex_gbps']:>7}")
    else:
        print(f"  {'memcpy (ceiling)':<24} {'':>23}  both {r['memcpy_gbps']:>7}")
    for mode, m in r["modes"].items():
        label = f"{mode} ({m['copy_impl']})"
        print(f"  {label:<24} h2d {m.get('h2d_gbps', '-'):>7}  d2h {m.get('d2h_gbps', '-'):>7}  both {m['effective_gbps']:>7}")
    goals = ", ".join(f"{k} {g['value']} {'ok' if g['met'] else 'MISSED'} (>= {g['target']})" for k, g in r["goals"].items())
    print(f"  goals: {goals}")
EOF
exit $TEST_RC
