#!/usr/bin/env bash
# Device check of the compiled budget op on a GPU machine (torch with CUDA + nvcc; no vLLM, no network needed):
#   1. build echo_vllm._C with its CUDA kernel in place (pip install --no-deps --no-build-isolation -e .);
#   2. the equivalence tests against the torch reference, gpu-marked ones included (ECHO_REQUIRE_CSRC=1: a
#      missing build fails instead of skipping);
#   3. the benchmark (CPU and CUDA), JSON to ${OUT:-.}/bench_device.json, and a short table.
# Usage: scripts/device_check.sh            (PYTHON=/path/to/python to pick the interpreter)
# Budget: under 8 minutes on an H100/H200 class machine (each step has its own timeout).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT_DIR=${OUT:-.}
export ECHO_REQUIRE_CSRC=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
t0=$(date +%s)
step() { echo; echo "== [$(( $(date +%s) - t0 ))s] $*"; }

step "environment"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" - <<'PY'
import torch
print(f"torch {torch.__version__} cuda={torch.version.cuda} device={torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}")
assert torch.cuda.is_available(), "no CUDA device visible to torch"
assert torch.version.cuda, "torch is not a CUDA build"
for mod in ("pytest", "hypothesis"):
    __import__(mod)
PY

step "build (pip install --no-deps --no-build-isolation -e .)"
b0=$(date +%s)
timeout 300 "$PY" -m pip install --no-deps --no-build-isolation -e . >"$OUT_DIR/device_build.log" 2>&1 \
  || { tail -n 60 "$OUT_DIR/device_build.log"; echo "BUILD FAILED"; exit 1; }
build_s=$(( $(date +%s) - b0 ))
echo "built in ${build_s}s"
"$PY" -c "
import echo_vllm.ops as ops
impl = ops.active_implementation(); print(impl)
assert impl['cpu'] == 'csrc' and impl['cuda'] == 'csrc', impl
"

step "equivalence tests (cpu + gpu)"
tests_rc=0
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_ops_budget.py tests/test_ops_build.py \
  2>&1 | tee "$OUT_DIR/device_tests.log" | tail -n 30 || tests_rc=$?
grep -E "passed|failed|error" "$OUT_DIR/device_tests.log" | tail -n 1 || true

step "benchmark"
bench_rc=0
timeout 150 "$PY" -m echo_vllm.cli bench ops --json "$OUT_DIR/bench_device.json" || bench_rc=$?

step "summary"
"$PY" - "$OUT_DIR/bench_device.json" "$build_s" "$tests_rc" "$bench_rc" <<'PY'
import json, sys
path, build_s, tests_rc, bench_rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
print(f"build {build_s}s | tests {'ok' if tests_rc == 0 else f'FAILED rc={tests_rc}'} | bench {'ok' if bench_rc == 0 else f'FAILED rc={bench_rc}'}")
try:
    rows = json.load(open(path))["results"]
except (OSError, ValueError):
    rows = []
print(f"{'device':>6} {'B':>4} {'N':>4} {'ref_us':>10} {'op_us':>8} {'graph_us':>9} {'ratio':>7}  match")
for r in rows:
    g = r.get("op_graph_us")
    print(f"{r['device']:>6} {r['B']:>4} {r['N']:>4} {r['reference_us']:10.1f} {r['op_us']:8.1f} "
          f"{(f'{g:9.1f}' if g is not None else '        -')} {r['ratio']:6.1f}x  {r['match']}")
target = [r for r in rows if r["device"] == "cuda" and r["B"] == 256 and r["N"] == 64]
if target:
    r = target[0]
    print(f"goal B=256 N=64 on cuda: op {r['op_us']:.1f} us (graph {r.get('op_graph_us') or float('nan'):.1f} us), target <= 20 us")
PY
echo "total $(( $(date +%s) - t0 ))s"
exit $(( tests_rc != 0 || bench_rc != 0 ))
