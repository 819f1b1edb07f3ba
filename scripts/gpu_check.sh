#!/usr/bin/env bash
# On a machine with a CUDA GPU: the CUDA tests, then the training benchmark on the GPU.
#   scripts/gpu_check.sh OUT_DIR
# Writes OUT_DIR/cuda_tests.log, OUT_DIR/bench.log and OUT_DIR/gpu/{results.json,summary.md,bench.png}.
# Needs odb importable (pip install -e '.[bench]' or PYTHONPATH=src) with transformers and trl.
set -u -o pipefail
out=${1:?usage: scripts/gpu_check.sh OUT_DIR}
mkdir -p "$out"
py=${PYTHON:-python3}
nvidia-smi -L || true
"$py" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0)); print('transformers', transformers.__version__)"
PYTHONUNBUFFERED=1 timeout "${TEST_TIMEOUT_S:-240}" "$py" -m pytest -q -p no:cacheprovider tests/cuda 2>&1 | tee "$out/cuda_tests.log"
PYTHONUNBUFFERED=1 timeout "${BENCH_TIMEOUT_S:-600}" "$py" -m odb.bench --device cuda --out "$out/gpu" \
    --skip-loader --skip-e2e --skip-packing --skip-auto 2>&1 | tee "$out/bench.log"
