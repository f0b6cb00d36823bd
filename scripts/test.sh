#!/usr/bin/env bash
# Set up (with the dev extra) and run the whole test suite, lint included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
export FLWR_TELEMETRY_ENABLED=0
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
