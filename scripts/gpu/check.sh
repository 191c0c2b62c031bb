#!/usr/bin/env bash
# One short run (< 5 min) on a lent GPU machine: CUDA IPC transport + the benchmark table on ~1B/100M models.
# That machine has torch/transformers/msgpack/uvloop/tqdm but not pyzmq: fetch its wheel here first with
#   bash scripts/gpu/fetch_wheels.sh     (writes .whl/, git-ignored; name .whl in the device call's carry)
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! python3 -c "import zmq" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD:$PYTHONPATH" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout 280 python3 scripts/gpu/check.py "$@" 2>&1 | tee "${OUT:-.}/gpu_check.log"
