#!/usr/bin/env bash
# The issue-13 sweep: B = 4, 16, 32 at temperature 0 and 1.0; minedraft with Tetris off/on, each with fixed
# k = 1..4 and with dynamic speculation, against target-alone, in one bench run per temperature.
#   bash scripts/sweep_tetris.sh                     # bundled pair, tables in sweep/t0.txt and sweep/t1.0.txt
#   TARGET=dir DRAFT=dir bash scripts/sweep_tetris.sh  # another pair (e.g. the real-model issue's)
#   bash scripts/sweep_tetris.sh --repeats 1 --max-tokens 8 --batch 4   # smoke run: later flags win
set -euo pipefail
out=${OUT:-sweep}
mkdir -p "$out"
for t in 0 1.0; do
  minedraft bench --modes autoregressive minedraft --batch 4 16 32 --k 1 2 3 4 --tetris both --dynamic \
    --temperature "$t" --max-tokens 64 --repeats 3 ${TARGET:+--target "$TARGET"} ${DRAFT:+--draft "$DRAFT"} "$@" \
    | tee "$out/t$t.txt"
done
