#!/usr/bin/env bash
# Launch `vllm serve` with ECHO over a running Ray cluster (run on the head node, after start-head.sh and
# start-worker.sh on the other nodes).
#
#   serve.sh MODEL [--speculative-config ECHO_JSON] [--tensor-parallel-size N] [--pipeline-parallel-size M]
#            [OTHER VLLM SERVE ARGS...]
#
#   MODEL                     target model (path on every node, or hub id)
#   --speculative-config      echo.json (default $ECHO_CONFIG or ./echo.json); a file, validated here first
#   --tensor-parallel-size    default 1 (-tp also accepted)
#   --pipeline-parallel-size  default 1 (-pp also accepted)
# Runs: vllm serve MODEL --speculative-config ECHO_JSON --tensor-parallel-size N --pipeline-parallel-size M
#       --distributed-executor-backend ray OTHER...
# Checks first: echo-vllm importable, echo.json valid, the Ray cluster has >= N x M GPUs
# (ECHO_SKIP_RAY_CHECK=1 skips the last). Environment: PYTHON (default python3), VLLM (default vllm).
set -euo pipefail
# shellcheck source=lib.sh disable=SC1091  # lib.sh is linted on its own
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PYTHON="${PYTHON:-python3}"
VLLM="${VLLM:-vllm}"
config="${ECHO_CONFIG:-echo.json}"
tp=1
pp=1
rest=()



case "${1:-}" in
  -h | --help) usage; exit 0 ;;
  "" | -*) die "MODEL is required as the first argument: serve.sh MODEL [--speculative-config echo.json] ... (see --help)" ;;
esac
model="$1"
shift

while [[ $# -gt 0 ]]; do
  case "$1" in
    --speculative-config) config="${2:?--speculative-config needs a value}"; shift 2 ;;
    --speculative-config=*) config="${1#*=}"; shift ;;
    --tensor-parallel-size | -tp) tp="${2:?$1 needs a value}"; shift 2 ;;
    --tensor-parallel-size=*) tp="${1#*=}"; shift ;;
    --pipeline-parallel-size | -pp) pp="${2:?$1 needs a value}"; shift 2 ;;
    --pipeline-parallel-size=*) pp="${1#*=}"; shift ;;
    --distributed-executor-backend | --distributed-executor-backend=*)
      die "serve.sh always uses --distributed-executor-backend ray; do not pass it" ;;
    -h | --help) usage; exit 0 ;;
    *) rest+=("$1"); shift ;;
  esac
done

[[ "$tp" =~ ^[1-9][0-9]*$ ]] || die "--tensor-parallel-size must be a positive integer, got '$tp'"
[[ "$pp" =~ ^[1-9][0-9]*$ ]] || die "--pipeline-parallel-size must be a positive integer, got '$pp'"

require_echo_vllm
command -v "$VLLM" >/dev/null 2>&1 || die "'$VLLM' not found: install vllm==0.32.0 on every node"

[[ "$config" != "{"* ]] || die "--speculative-config must be a file (echo.json), not inline JSON"
[[ -f "$config" ]] || die "speculative config '$config' does not exist (pass --speculative-config FILE)"
"$PYTHON" -m echo_vllm.cli deploy echo-json "$config" || die "invalid speculative config $config (see above)"

if [[ "${ECHO_SKIP_RAY_CHECK:-0}" != 1 ]]; then
  "$PYTHON" -m echo_vllm.cli deploy ray-gpus --need $((tp * pp)) \
    || die "the Ray cluster cannot hold TP $tp x PP $pp (start-head.sh / start-worker.sh on every node first)"
fi

cmd=("$VLLM" serve "$model" --speculative-config "$config" --tensor-parallel-size "$tp"
  --pipeline-parallel-size "$pp" --distributed-executor-backend ray ${rest[@]+"${rest[@]}"})
echo "serve.sh: ${cmd[*]}"
exec "${cmd[@]}"
