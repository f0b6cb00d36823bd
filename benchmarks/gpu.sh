#!/usr/bin/env bash
# Issues 4 and 48: the CUDA tests and the GPU benchmarks, each output saved in OUTDIR.
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
step $PY -m pytest -q -p no:cacheprovider tests/library/test_codec.py tests/library/test_lion.py tests/app/test_federation.py \
  tests/library/test_client_state.py tests/library/test_client_api.py tests/library/test_client_trust.py 2>&1 \
  | tee "$out/tests.txt" || { echo "gpu.sh: the CUDA tests failed; no benchmarks of failing code" >&2; exit 1; }
step $PY benchmarks/codec_speed.py --device cuda --apply --repeat 20 2>&1 | tee "$out/codec_speed_cuda.txt"
step $PY benchmarks/gpu_launch.py 2>&1 | tee "$out/gpu_launch.txt"
step $PY benchmarks/gpu_client.py 2>&1 | tee "$out/gpu_client.txt"
step $PY benchmarks/round_time.py --rounds 30 --device cuda 2>&1 | tee "$out/round_time_cuda.txt"
# issue 48: ResNet-18 (the example's model and client) on the in-process grid, 6 rounds: rounds, bookkeeping, bytes
step $PY benchmarks/resnet18_round.py --rounds 6 --nodes 2 2>&1 | tee "$out/resnet18_round_cuda.txt"
step $PY benchmarks/client_memory.py --model resnet18 --clients 10 100 --device cuda 2>&1 | tee "$out/client_memory_cuda.txt"
