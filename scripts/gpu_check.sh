#!/usr/bin/env bash
# One short run (< 5 min) on a lent GPU machine: CUDA IPC transport + the benchmark table on ~1B/100M models.
# That machine has torch/transformers/msgpack/uvloop but not pyzmq: put a pyzmq wheel in wheels/ first
#   (pip download pyzmq --only-binary :all: --python-version 3.X -d wheels) and carry it.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import zmq" 2>/dev/null || pip install --no-index --find-links wheels pyzmq
python -c "import tqdm" 2>/dev/null || pip install --no-index --find-links wheels tqdm || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
timeout 280 python scripts/gpu_check.py "$@" 2>&1 | tee "${OUT:-.}/gpu_check.log"
