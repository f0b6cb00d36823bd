#!/usr/bin/env bash
# Register a device's public key with the SuperLink (run where `flwr` has the connection, see README).
# Usage: register-device.sh PUBLIC_KEY [CONNECTION]      (default connection: edge)
set -euo pipefail
flwr supernode register "$1" "${2:-edge}"
