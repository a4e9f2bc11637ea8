#!/usr/bin/env bash
# Device checks on a GPU machine (torch with CUDA + nvcc; no vLLM, no network needed), in one call:
#   1. the GPU tests that need no build: the CUDA tree fix-up's torch parts (tests/test_tree_attn_split.py: the
#      split recompute on CUDA vs the dense reference, no host sync) and the chain step's torch twins on CUDA
#      (tests/test_chain_select.py: same selection as the CPU specification, draft steps never sync);
#   2. cost breakdowns: the tree fix-up per layer on Llama-8B attention shapes (scripts/time_tree_fix_cuda.py)
#      and the verification cost of an 8B-shaped layer under CUDA graphs (scripts/time_verify_cost_cuda.py);
#   3. build echo_vllm._C with its CUDA kernel in place (setup.py build_ext --inplace), its
#      equivalence tests, gpu-marked ones included (ECHO_REQUIRE_CSRC=1: a missing build fails instead of
#      skipping), and the budget-op benchmark (CPU and CUDA);
#   4. `echo-vllm bench verify-cost` on the 8B-shaped slice (the eager Hugging Face forward, for comparison).
# Everything lands under ${OUT:-.}: device_steps.log (every step's whole output) and *.json; a summary last.
# Usage: scripts/device_check.sh            (PYTHON=/path/to/python to pick the interpreter;
#        ECHO_DEVICE_STEPS="tests_torch build tests_ops" to run some steps only)
# Budget: about 6 minutes on an H200 (each step has its own timeout; the build is the slow part).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT_DIR=${OUT:-.}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
t0=$(date +%s)
declare -A RC
LOGS=$(mktemp -d)
step() { echo; echo "== [$(( $(date +%s) - t0 ))s] $*"; }
STEPS=${ECHO_DEVICE_STEPS:-tests_torch tree_fix verify_cost build tests_ops bench_ops verify_cost_hf}
run() {  # run NAME TIMEOUT CMD...: whole output appended to $OUT_DIR/device_steps.log, tail shown, rc kept
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) echo "(skipped: not in ECHO_DEVICE_STEPS)"; return 0 ;; esac
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  RC[$name]=$?
  { echo "===== $name (rc=${RC[$name]})"; cat "$LOGS/$name.log"; } >>"$OUT_DIR/device_steps.log"
  tail -n 25 "$LOGS/$name.log"
}

# The image has no pydantic (echo_vllm.core's calibration needs it): carried as wheels in .whl when present
# (README of the device tool: `pip download --no-deps ... -d .whl pydantic pydantic-core annotated-types
# typing-inspection`).
if [ -d .whl ] && ! "$PY" -c "import pydantic" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

step "environment"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PY" -c "
import torch
print(f'torch {torch.__version__} cuda={torch.version.cuda} device={torch.cuda.get_device_name(0)}')
import pytest, hypothesis, numpy, transformers, pydantic, triton
print('pytest', pytest.__version__, 'numpy', numpy.__version__, 'triton', triton.__version__, 'pydantic', pydantic.__version__)
" || { echo "no usable CUDA torch"; exit 1; }

step "GPU tests without a build (tree split recompute, its Triton kernel, chain twins)"
run tests_torch 150 "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_tree_attn_split.py \
  tests/test_tree_attn_triton.py tests/test_chain_select.py

step "tree fix-up cost per layer (Llama-8B attention shapes)"
run tree_fix 90 "$PY" scripts/time_tree_fix_cuda.py --json "$OUT_DIR/tree_fix_cuda.json"

step "verification cost under CUDA graphs (8B-shaped layer)"
run verify_cost 120 "$PY" scripts/time_verify_cost_cuda.py --json "$OUT_DIR/verify_cost_cuda.json"

# In place with setup.py: `pip install -e .` re-enters pip with an isolated build env (setuptools from an index),
# and the device has none.
step "build (setup.py build_ext --inplace)"
b0=$(date +%s)
run build 200 "$PY" setup.py -q build_ext --inplace
echo "build rc=${RC[build]} in $(( $(date +%s) - b0 ))s"
if [ -n "${RC[build]:-}" ]; then
  "$PY" -c "
import echo_vllm.ops as ops
impl = ops.active_implementation(); print(impl)
assert impl['cpu'] == 'csrc' and impl['cuda'] == 'csrc', impl
"
  RC[build_check]=$?
fi

step "budget op equivalence tests (cpu + gpu)"
run tests_ops 100 env ECHO_REQUIRE_CSRC=1 "$PY" -m pytest -q -p no:cacheprovider tests/test_ops_budget.py tests/test_ops_build.py

step "budget op benchmark"
run bench_ops 80 "$PY" -m echo_vllm.cli bench ops --json "$OUT_DIR/bench_device.json"

step "verify-cost (Hugging Face forward, eager: launch overhead included)"
run verify_cost_hf 60 "$PY" -m echo_vllm.cli bench verify-cost --model-shape llama-8b-slice --context 1024 \
  --max-tokens 2048 --json "$OUT_DIR/verify_cost_hf.json"

step "summary"
for name in tests_torch tree_fix verify_cost build build_check tests_ops bench_ops verify_cost_hf; do
  printf '%-12s rc=%s  %s\n' "$name" "${RC[$name]:-not run}" \
    "$(grep -E '[0-9]+ (passed|failed)' "$LOGS/$name.log" 2>/dev/null | tail -n 1)"
done
"$PY" - "$OUT_DIR/bench_device.json" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["results"]
except (OSError, ValueError, KeyError):
    rows = []
for r in rows:
    if r["device"] == "cuda":
        g = r.get("op_graph_us")
        print(f"budget op cuda B={r['B']:>4} N={r['N']:>4}: ref {r['reference_us']:.1f} us, op {r['op_us']:.1f} us, "
              f"graph {g if g is None else round(g, 1)} us, match {r['match']}")
PY
echo "total $(( $(date +%s) - t0 ))s"
fail=0
for v in "${RC[@]}"; do [ "$v" = 0 ] || fail=1; done
exit $fail
