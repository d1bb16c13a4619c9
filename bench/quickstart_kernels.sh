#!/usr/bin/env bash
# The quick start's run (launch --num_gpus 2 train_bert, configs/bert_tiny_ddp.json, 300 steps
# on the corpus) with the BLAS kernel polytrain runs by default against the same binary with
# OpenBLAS's SSE3 fall-back forced (OPENBLAS_CORETYPE=Prescott, what Debian's OpenBLAS 0.3.21
# picks on CPUs it does not know), alternated, ROUNDS each: wall time, kernel, final loss.
# Usage: bench/quickstart_kernels.sh [BUILD_DIR]   env: ROUNDS (2), OLD (Prescott)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
ROUNDS="${ROUNDS:-2}" OLD="${OLD:-Prescott}"
cd "$ROOT"
unset OMP_NUM_THREADS
"$BUILD/bench_bert_step" cpu 0 0 | grep '^cpu '
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
for ((r = 1; r <= ROUNDS; r++)); do
  for k in default "$OLD"; do
    env=(env -u OPENBLAS_CORETYPE); [[ $k != default ]] && env=(env OPENBLAS_CORETYPE="$k")
    s=$(date +%s.%N)
    out=$("${env[@]}" "$BUILD/launch" --num_gpus 2 "$BUILD/train_bert" --config configs/bert_tiny_ddp.json \
      --no_progress_bar --experiments_dir "$tmp/exp" --save_interval 0 2>&1)
    e=$(date +%s.%N)
    printf "%-9s %7.1f s | %s | %s\n" "$k" "$(awk -v a="$s" -v b="$e" 'BEGIN{print b - a}')" \
      "$(echo "$out" | grep -o 'kernel [A-Za-z]*' | head -1)" "$(echo "$out" | grep -o 'final loss [0-9.]*' | head -1)"
  done
done
