#!/usr/bin/env bash
# Start the SuperLink with TLS and SuperNode authentication (only registered devices may connect).
# Usage: start-superlink.sh CREDENTIALS_DIR [HOST] [PORT]      (defaults: 0.0.0.0 8000)
# Its state (runs, registered keys) is kept in $DATABASE (default CREDENTIALS_DIR/superlink.db).
set -euo pipefail
creds=$1 host=${2:-0.0.0.0} port=${3:-8000}
exec flower-superlink --host "$host" --port "$port" \
  --ssl-certfile "$creds/certs/server.pem" --ssl-keyfile "$creds/certs/server.key" \
  --ssl-ca-certfile "$creds/certs/ca.crt" \
  --enable-supernode-auth --database "${DATABASE:-$creds/superlink.db}"
