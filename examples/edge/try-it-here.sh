#!/usr/bin/env bash
# The whole edge setup on this machine: a SuperLink and N pretend devices on 127.0.0.1, with TLS and
# SuperNode authentication, each device with its own data and no partition-id; then a D-Lion run.
# Usage: bash try-it-here.sh [NUM_DEVICES] [ROUNDS] [RUN_CONFIG]   (defaults: 2 devices, 3 rounds, "")
#   e.g. the secure variant: bash try-it-here.sh 3 3 "secure=true min-train-nodes=3"
# Every process it starts is stopped at the end (also on failure); it exits non-zero unless the run
# finished as completed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
devices=${1:-2} rounds=${2:-3} extra=${3:-}
work=$(mktemp -d)
export FLWR_HOME="$work/flwr-home" FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
pids=()
stop() { for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap stop EXIT
free_port() { python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

port=$(free_port)
bash "$here/make-credentials.sh" "$work/creds" 127.0.0.1 "$devices" 1
python "$here/make-device-data.py" "$work/data" "$devices"
DATABASE="$work/superlink.db" setsid bash "$here/start-superlink.sh" "$work/creds" 127.0.0.1 "$port" \
  > "$work/superlink.log" 2>&1 & pids+=($!)

mkdir -p "$FLWR_HOME"
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "edge"

[superlink.edge]
address = "127.0.0.1:$port"
root-certificates = "$work/creds/certs/ca.crt"
insecure = false
TOML
for _ in $(seq 60); do flwr ls edge --format json 2>/dev/null | grep -q '"success": true' && break; sleep 1; done

for i in $(seq 0 $((devices - 1))); do
  bash "$here/register-device.sh" "$work/creds/keys/node$i.pub" edge
  setsid bash "$here/start-supernode.sh" "127.0.0.1:$port" "$work/creds/certs/ca.crt" \
    "$work/creds/keys/node$i" "$work/data/device$i" "$(free_port)" > "$work/device$i.log" 2>&1 & pids+=($!)
done

out=$(flwr run "$here" edge --run-config "num-server-rounds=$rounds min-available-nodes=$devices $extra" 2>&1)
echo "$out"
run_id=$(echo "$out" | grep -o 'run [0-9]*' | grep -o '[0-9]*$' | tail -1)
status=""
for _ in $(seq 600); do
  status=$(flwr ls --run-id "$run_id" edge --format json | python -c 'import json,sys; print(json.load(sys.stdin)["runs"][0]["status"])')
  case "$status" in finished*) break ;; esac
  sleep 2
done
flwr log "$run_id" edge --show 2>/dev/null | grep -E "round|accuracy|ERROR" || true
echo "[edge] run $run_id: $status (logs in $work)"
[ "$status" = "finished:completed" ]
