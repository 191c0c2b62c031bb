#!/usr/bin/env bash
# Wheels the lent GPU machine lacks (Python 3.12 there, nothing can be downloaded on it) into .whl/.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl pyzmq==27.3.0
ls -l .whl
