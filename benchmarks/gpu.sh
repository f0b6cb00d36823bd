#!/usr/bin/env bash
# Issue 4, item 4: the CUDA tests and the GPU benchmarks, each output saved in OUTDIR.
#
#   bash benchmarks/gpu.sh [OUTDIR]      (default: gpu-results; STEP_TIMEOUT=seconds caps each step)
#
# Needs a CUDA device and flower-dlion's test dependencies (bash scripts/setup.sh --dev).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
mkdir -p "$out"
PY=${PYTHON:-python3}
step() { timeout "${STEP_TIMEOUT:-0}" "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
step $PY -m pytest -q -p no:cacheprovider tests/test_codec.py tests/test_lion.py tests/test_federation.py 2>&1 \
  | tee "$out/tests.txt" || { echo "gpu.sh: the CUDA tests failed; no benchmarks of failing code" >&2; exit 1; }
step $PY benchmarks/codec_speed.py --device cuda --apply --repeat 20 2>&1 | tee "$out/codec_speed_cuda.txt"
step $PY benchmarks/gpu_launch.py 2>&1 | tee "$out/gpu_launch.txt"
step $PY benchmarks/gpu_client.py 2>&1 | tee "$out/gpu_client.txt"
step $PY benchmarks/round_time.py --rounds 30 --device cuda 2>&1 | tee "$out/round_time_cuda.txt"
