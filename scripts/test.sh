#!/usr/bin/env bash
# Set up (with the dev extra) and run the whole test suite, lint included; then check that every one of the
# library's test files collects with the repository's app blocked (FLOWER_DLION_NO_APP=1, tests/no_app.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
export FLWR_TELEMETRY_ENABLED=0
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
# the library's tests: tests/library/ once the tests are split, until then every test file that is not the app's
# (python -m tests.no_app: all but its APP_TESTS); none may import flower_dlion_app, even at collection
if [ -d tests/library ]; then
    library=(tests/library)
else
    mapfile -t library < <(.venv/bin/python -m tests.no_app)
fi
if ! collected=$(FLOWER_DLION_NO_APP=1 .venv/bin/python -m pytest --collect-only -q -p no:cacheprovider "${library[@]}" 2>&1)
then
    echo "$collected"
    echo "scripts/test.sh: a library test needs the app (FLOWER_DLION_NO_APP=1 blocks it); see above" >&2
    exit 1
fi
echo "without the app: ${collected##*$'\n'}"
