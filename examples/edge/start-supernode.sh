#!/usr/bin/env bash
# On a device: start its SuperNode. It has no partition-id: the server knows it by its node id,
# which SuperNode authentication keeps the same across restarts.
# Usage: start-supernode.sh SUPERLINK_ADDRESS CA_CERT PRIVATE_KEY DATA_DIR [PORT]   (PORT default 9094)
# DATA_DIR holds the device's own train.npz (x: uint8 N×28×28, y: labels).
set -euo pipefail
exec flower-supernode --superlink "$1" --root-certificates "$2" --auth-supernode-private-key "$3" \
  --node-config "data-dir='$4'" --port "${5:-9094}"
