#!/usr/bin/env bash
# Make a deployment's credentials: a CA, the SuperLink's TLS certificate, one key pair per device.
# Usage: make-credentials.sh OUT_DIR SUPERLINK_HOST NUM_DEVICES [DAYS]
#   OUT_DIR/certs/ca.crt            every device gets a copy
#   OUT_DIR/certs/server.{pem,key}  the SuperLink's, stay on its machine
#   OUT_DIR/keys/node<i>            device i's private key, goes to that device only
#   OUT_DIR/keys/node<i>.pub        registered with the SuperLink (register-device.sh)
set -euo pipefail
out=$1 host=$2 nodes=$3 days=${4:-365}
python -m flower_dlion_app.deploy certs --out "$out" --host "$host" --nodes "$nodes" --days "$days"
