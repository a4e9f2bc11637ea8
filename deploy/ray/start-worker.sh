#!/usr/bin/env bash
# Join this node to the Ray cluster of a multi-node echo-vllm deployment.
#
#   start-worker.sh HEAD_ADDRESS [--port PORT] [--node-ip IP] [--num-gpus N] [--timeout SECONDS] [--block]
#                   [-- EXTRA RAY START ARGS...]
#
#   HEAD_ADDRESS  the head node's address (host or IP; host:port also accepted)
#   --port        the head's GCS port when HEAD_ADDRESS has none (default $RAY_PORT or 6379)
#   --node-ip     this node's address (default $VLLM_HOST_IP, $POD_IP, else Ray's guess)
#   --num-gpus    GPUs Ray may use here (default: Ray detects them)
#   --timeout     how long to wait for the head to come up (default 600 s)
#   --block       stay in the foreground while the Ray node runs (containers)
# Environment: PYTHON (default python3), RAY (default ray), ECHO_RAY_POLL_S (poll interval, default 5 s).
set -euo pipefail
# shellcheck source=lib.sh disable=SC1091  # lib.sh is linted on its own
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PYTHON="${PYTHON:-python3}"
RAY="${RAY:-ray}"
port="${RAY_PORT:-6379}"
node_ip="${VLLM_HOST_IP:-${POD_IP:-}}"
num_gpus=""
timeout_s=600
poll_s="${ECHO_RAY_POLL_S:-5}"
block=0
head=""
extra=()



while [[ $# -gt 0 ]]; do
  case "$1" in
    --port) port="${2:?--port needs a value}"; shift 2 ;;
    --node-ip) node_ip="${2:?--node-ip needs a value}"; shift 2 ;;
    --num-gpus) num_gpus="${2:?--num-gpus needs a value}"; shift 2 ;;
    --timeout) timeout_s="${2:?--timeout needs a value}"; shift 2 ;;
    --block) block=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *)
      [[ -z "$head" ]] || die "more than one HEAD_ADDRESS ('$head', '$1')"
      head="$1"; shift ;;
  esac
done

[[ -n "$head" ]] || die "HEAD_ADDRESS is required: start-worker.sh HEAD_ADDRESS [options] (see --help)"
[[ "$timeout_s" =~ ^[0-9]+$ ]] || die "--timeout must be a number of seconds, got '$timeout_s'"
[[ "$head" == *:* ]] || head="$head:$port"

require_echo_vllm
command -v "$RAY" >/dev/null 2>&1 || die "'$RAY' not found: pip install 'echo-vllm[ray]' (ray[default])"

# The head may still be starting (e.g. its pod was created at the same time): wait for its GCS.
deadline=$((SECONDS + timeout_s))
until "$RAY" health-check --address "$head" >/dev/null 2>&1; do
  ((SECONDS < deadline)) || die "no Ray head answered at $head within ${timeout_s}s"
  echo "start-worker.sh: waiting for the Ray head at $head"
  sleep "$poll_s"
done

args=(start --address="$head" --disable-usage-stats)
[[ -n "$node_ip" ]] && args+=(--node-ip-address="$node_ip")
[[ -n "$num_gpus" ]] && args+=(--num-gpus="$num_gpus")
((block)) && args+=(--block)
echo "start-worker.sh: $RAY ${args[*]} ${extra[*]}"
exec "$RAY" "${args[@]}" ${extra[@]+"${extra[@]}"}
