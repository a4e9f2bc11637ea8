#!/usr/bin/env bash
# Start the Ray head node of a multi-node echo-vllm deployment (run serve.sh on this node afterwards).
#
#   start-head.sh [--port PORT] [--node-ip IP] [--num-gpus N] [--expect-nodes N] [--timeout SECONDS]
#                 [-- EXTRA RAY START ARGS...]
#
#   --port          GCS port (default $RAY_PORT or 6379)
#   --node-ip       address the other nodes reach this one at (default $VLLM_HOST_IP, $POD_IP, else Ray's guess)
#   --num-gpus      GPUs Ray may use here (default: Ray detects them)
#   --expect-nodes  wait until the cluster has this many alive nodes, head included (default 1: no wait)
#   --timeout       how long to wait for them (default 600 s)
# Environment: PYTHON (default python3), RAY (default ray), ECHO_RAY_POLL_S (poll interval, default 5 s).
set -euo pipefail
# shellcheck source=lib.sh disable=SC1091  # lib.sh is linted on its own
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PYTHON="${PYTHON:-python3}"
RAY="${RAY:-ray}"
port="${RAY_PORT:-6379}"
node_ip="${VLLM_HOST_IP:-${POD_IP:-}}"
num_gpus=""
expect_nodes=1
timeout_s=600
extra=()



while [[ $# -gt 0 ]]; do
  case "$1" in
    --port) port="${2:?--port needs a value}"; shift 2 ;;
    --node-ip) node_ip="${2:?--node-ip needs a value}"; shift 2 ;;
    --num-gpus) num_gpus="${2:?--num-gpus needs a value}"; shift 2 ;;
    --expect-nodes) expect_nodes="${2:?--expect-nodes needs a value}"; shift 2 ;;
    --timeout) timeout_s="${2:?--timeout needs a value}"; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

[[ "$expect_nodes" =~ ^[1-9][0-9]*$ ]] || die "--expect-nodes must be a positive integer, got '$expect_nodes'"
[[ "$timeout_s" =~ ^[0-9]+$ ]] || die "--timeout must be a number of seconds, got '$timeout_s'"

require_echo_vllm
command -v "$RAY" >/dev/null 2>&1 || die "'$RAY' not found: pip install 'echo-vllm[ray]' (ray[default])"

args=(start --head --port="$port" --disable-usage-stats)
[[ -n "$node_ip" ]] && args+=(--node-ip-address="$node_ip")
[[ -n "$num_gpus" ]] && args+=(--num-gpus="$num_gpus")
echo "start-head.sh: $RAY ${args[*]} ${extra[*]}"
"$RAY" "${args[@]}" ${extra[@]+"${extra[@]}"}

if ((expect_nodes > 1)); then
  echo "start-head.sh: waiting up to ${timeout_s}s for $expect_nodes Ray nodes"
  "$PYTHON" - "$expect_nodes" "$timeout_s" "${node_ip:-127.0.0.1}:$port" "${ECHO_RAY_POLL_S:-5}" <<'PY'
import sys, time

import ray

want, timeout, address, poll = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], float(sys.argv[4])
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
deadline = time.monotonic() + timeout
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= want:
        gpus = sum(n["Resources"].get("GPU", 0) for n in alive)
        print(f"start-head.sh: {len(alive)} Ray nodes up, {gpus:g} GPUs")
        break
    if time.monotonic() > deadline:
        sys.exit(f"start-head.sh: error: only {len(alive)} of {want} Ray nodes joined within {timeout:g}s")
    time.sleep(poll)
PY
fi
