# shellcheck shell=bash
# Shared by start-head.sh, start-worker.sh and serve.sh (sourced, not run).

die() {
  echo "$(basename "$0"): error: $*" >&2
  exit 1
}

# The script's leading comment block is its --help.
usage() {
  sed -n '2,/^set -euo pipefail/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'
}

# vLLM loads the ECHO plugin in every process on every node: echo-vllm must be installed here. The check runs
# from / so that a source checkout in the current directory does not count as installed. Sets PYTHON to an
# absolute path.
require_echo_vllm() {
  local py err
  py="$(command -v "$PYTHON")" || die "python interpreter '$PYTHON' not found (set PYTHON)"
  [[ "$py" == /* ]] || py="$PWD/$py"
  PYTHON="$py"
  if ! err="$(cd / && "$PYTHON" -c '
import importlib.metadata as md
import echo_vllm
if not any(e.name == "echo" for e in md.entry_points(group="vllm.general_plugins")):
    raise SystemExit("echo_vllm imports, but its vllm.general_plugins entry point is not installed")
' 2>&1)"; then
    die "echo-vllm is not importable with $PYTHON on $(hostname): ${err##*$'\n'}
Install it on every node first (pip install --no-build-isolation /path/to/echo-vllm), or use the echo-vllm image."
  fi
}
