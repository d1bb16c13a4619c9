#!/usr/bin/env bash
# env_type deepspeed step time on this machine: train_bert (the tiny BERT of
# configs/bert_tiny.json, dropout on, sparse prediction) at 2 ranks x 1 thread, ZeRO stage 2 with
# the optimizer offloaded (the CPU Adam, fp32 master in CPU memory) against stage 0 (plain data
# parallel, every rank updates everything) on the same ranks, batch and steps, side by side in
# one run. Prints the mean step time of each after the first log interval and their ratio.
# Usage: bench/zero_step.sh [BUILD_DIR]   (STEPS=60 by default)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
STEPS="${STEPS:-60}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
export OMP_NUM_THREADS=1
cd "$ROOT"
run() {  # name, extra flags
  "$BUILD/launch" --master_port $((29700 + RANDOM % 200)) --num_gpus 2 "$BUILD/train_bert" --config configs/bert_tiny.json \
    --env_type deepspeed --train_batch_size 16 --train_micro_batch_size_per_gpu 8 --max_steps "$STEPS" \
    --log_interval 10 --eval_interval 100000 --save_interval 100000 --no_progress_bar --num_threads 1 \
    --experiments_dir "$OUT/exp" --experiment_name "$1" --save_dir "$OUT/$1" "${@:2}" > "$OUT/$1.log" 2>&1 \
    || { cat "$OUT/$1.log"; exit 1; }
  # ms_per_step of every log record but the first (warm-up), averaged.
  find "$OUT/exp" -path "*$1*" -name metrics.jsonl -exec cat {} + |
    python3 -c 'import json,sys; v=[json.loads(l)["ms_per_step"] for l in sys.stdin if "ms_per_step" in l][1:]; print(sum(v)/len(v))'
}
s0=$(run stage0 --zero_stage 0)
s2=$(run stage2_offload --zero_stage 2 --offload_optimizer cpu)
awk -v a="$s0" -v b="$s2" 'BEGIN{printf "train_bert tiny, 2 ranks x 1 thread, micro 8 x 128 tokens: stage 0 %.1f ms/step, stage 2 + offload %.1f ms/step, ratio %.3f\n", a, b, b/a}'
