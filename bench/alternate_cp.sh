#!/usr/bin/env bash
# The 8B wall against `cp`, alternating: cp -r + sync, then ckptconv convert (+ sync), N times,
# each timed from outside, so both see the same disk and the same neighbours on a shared machine.
#
#   bash bench/alternate_cp.sh [SRC=bench/work/inputs/llama3-8b] [N=3]
set -euo pipefail
cd "$(dirname "$0")/.."
SRC="${1:-bench/work/inputs/llama3-8b}"
N="${2:-3}"
OUT="${TMPDIR:-/tmp}/ckptconv-alternate"
for i in $(seq 1 "$N"); do
  rm -rf "$OUT-cp" "$OUT-ckptconv"; sync
  s=$(date +%s.%N); cp -r "$SRC" "$OUT-cp" && sync; e=$(date +%s.%N)
  cp_s=$(echo "$e - $s" | bc)
  rm -rf "$OUT-cp"; sync
  s=$(date +%s.%N)
  .venv/bin/python -m ckptconv convert "$SRC" "$OUT-ckptconv" --devices 16 --progress none > "$OUT.log" 2>&1
  sync; e=$(date +%s.%N)
  ck_s=$(echo "$e - $s" | bc)
  echo "run $i: cp+sync ${cp_s} s, ckptconv ${ck_s} s ($(grep -o 'CPU [0-9.]*s' "$OUT.log")), ratio $(echo "scale=2; $ck_s / $cp_s" | bc)"
  rm -rf "$OUT-ckptconv"
done
