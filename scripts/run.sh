#!/usr/bin/env bash
# Set up, then run the default federation with `flwr run`: 10 simulated SuperNodes,
# Fashion-MNIST with a Dirichlet(0.5) label split, Distributed Lion with majority vote.
# Extra arguments go to `flwr run` (e.g. --run-config "aggregation='mean'").
# Exits non-zero unless Flower reports the run as finished:completed.
#
# The run gets a SuperLink of its own: its own Flower home (FLWR_HOME, a new folder under
# .flwr-runs/ unless you set one) and free ports, and that SuperLink is stopped, by its process
# group, when the run ends (also on failure or Ctrl-C). No other `flwr run` on this machine is
# served by it, and it is served by no SuperLink another run left behind. Its log stays in
# $FLWR_HOME/local-superlink/superlink.log.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export FLWR_TELEMETRY_ENABLED=0
# flwr would otherwise `uv sync` the app's dependencies into a new environment (GBs of torch)
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export PATH="$PWD/.venv/bin:$PATH"
free_port() { python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
mkdir -p .flwr-runs
export FLWR_HOME="${FLWR_HOME:-$(mktemp -d "$PWD/.flwr-runs/run-XXXXXX")}"
export FLWR_LOCAL_SUPERLINK_HTTP_API_PORT="${FLWR_LOCAL_SUPERLINK_HTTP_API_PORT:-$(free_port)}"
export FLWR_LOCAL_CONTROL_API_PORT="${FLWR_LOCAL_CONTROL_API_PORT:-$(free_port)}"
stop_superlink() {  # ours only: the one started with this run's ports
  local pid
  for pid in $(pgrep -f "flower-superlink.*--port $FLWR_LOCAL_SUPERLINK_HTTP_API_PORT( |$)" || true); do
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  done
}
trap stop_superlink EXIT
echo "[run] Flower home $FLWR_HOME, local SuperLink on 127.0.0.1:$FLWR_LOCAL_SUPERLINK_HTTP_API_PORT (stopped at the end)"
log="$FLWR_HOME/flwr-run.log"
flwr run . --stream --federation-config "num-supernodes=${NUM_SUPERNODES:-10}" "$@" 2>&1 | tee "$log"
run_id=$(grep -o 'Successfully started run [0-9]*' "$log" | grep -o '[0-9]*$' | tail -1 || true)
[ -n "$run_id" ] || { echo "[run] the run did not start"; exit 1; }
status=$(flwr ls --run-id "$run_id" --format json | python3 -c 'import json,sys; print(json.load(sys.stdin)["runs"][0]["status"])')
echo "[run] run $run_id: $status"
[ "$status" = "finished:completed" ]
