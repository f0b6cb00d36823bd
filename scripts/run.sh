#!/usr/bin/env bash
# Set up, then run the default federation with `flwr run`: 10 simulated SuperNodes,
# Fashion-MNIST with a Dirichlet(0.5) label split, Distributed Lion with majority vote.
# Extra arguments go to `flwr run` (e.g. --run-config "aggregation='mean'").
# Exits non-zero unless Flower reports the run as finished:completed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export FLWR_TELEMETRY_ENABLED=0
# flwr would otherwise `uv sync` the app's dependencies into a new environment (GBs of torch)
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export PATH="$PWD/.venv/bin:$PATH"
log=$(mktemp)
flwr run . --stream --federation-config "num-supernodes=${NUM_SUPERNODES:-10}" "$@" 2>&1 | tee "$log"
run_id=$(grep -o 'Successfully started run [0-9]*' "$log" | grep -o '[0-9]*$' | tail -1 || true)
[ -n "$run_id" ] || { echo "[run] the run did not start"; exit 1; }
status=$(flwr ls --run-id "$run_id" --format json | python3 -c 'import json,sys; print(json.load(sys.stdin)["runs"][0]["status"])')
echo "[run] run $run_id: $status"
[ "$status" = "finished:completed" ]
