#!/usr/bin/env bash
# Set up (with the dev extra) and run the whole test suite, lint included: the library's tests
# (tests/library) with the repository's app blocked (FLOWER_DLION_NO_APP=1, tests/no_app.py: they
# pass without it), then the app's (tests/app). Options (-q, -x, -k ...) go to both runs; with a
# path among the arguments, pytest runs just what they name.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
export FLWR_TELEMETRY_ENABLED=0
.venv/bin/ruff check .
for arg in "$@"; do
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
        exec .venv/bin/python -m pytest "$@"
    fi
done
FLOWER_DLION_NO_APP=1 .venv/bin/python -m pytest tests/library "$@"
.venv/bin/python -m pytest tests/app "$@"
