#!/usr/bin/env bash
# What a global step of env_type hivemind costs over pytorchDDP on the same processes: 2
# train_bert processes (tiny BERT, 1 thread each, micro-batch 16, a global batch of 32 = one
# micro-batch per process per step) trained the same number of steps
#   (1) pytorchDDP through the launcher (comm_backend auto: Open MPI on one host since launch
#       serves PMIx; Gloo before, and with --no_mpi_world),
#   (2) hivemind peers (target_batch_size 32, expected_peers 2): a gradient round per step,
#   (3) hivemind with average_state_every 1 (the default): a gradient and a parameter round,
# and the compute alone (one process, batch 16, env_type pytorch) as the floor. Figures: the
# median ms per global step over steps 3..N (the first two warm up), and the overhead of each
# over DDP and over the compute floor. Ratios, not absolute times: this machine is noisy.
# Usage: bench/hivemind_overhead.sh [BUILD_DIR]   (STEPS=30 by default)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
STEPS="${STEPS:-30}"
for b in train_bert launch; do
  [ -x "$BUILD/$b" ] || { echo "error: $BUILD/$b not built" >&2; exit 2; }
done
OUT="$(mktemp -d /tmp/polytrain_hm_overhead.XXXXXX)"
trap 'rm -rf "$OUT"' EXIT
cd "$ROOT"
export OMP_NUM_THREADS=1
common=(--config configs/bert_tiny.json --max_steps "$STEPS" --log_interval 1 --eval_interval 100000
        --save_interval 0 --num_threads 1 --no_progress_bar --experiments_dir "$OUT/exp"
        --train_micro_batch_size_per_gpu 16)
# Median ms_per_step of an experiment's metrics.jsonl, steps 3.. only.
median() {
  local f
  f=$(find "$OUT/exp" -path "*/$1/metrics.jsonl" | head -1)
  python3 - "$f" <<'EOF'
import json, statistics, sys
ms = [r["ms_per_step"] for r in map(json.loads, open(sys.argv[1])) if "ms_per_step" in r][2:]
print(f"{statistics.median(ms):.1f}")
EOF
}

"$BUILD/train_bert" "${common[@]}" --env_type pytorch --train_batch_size 16 --experiment_name compute \
  --save_dir "$OUT/compute" >"$OUT/compute.log" 2>&1
"$BUILD/launch" --num_gpus 2 --master_port $((29600 + RANDOM % 300)) "$BUILD/train_bert" "${common[@]}" \
  --env_type pytorchDDP --train_batch_size 32 --experiment_name ddp --save_dir "$OUT/ddp" >"$OUT/ddp.log" 2>&1
swarm() {  # name, average_state_every
  local port=$((31400 + RANDOM % 500)) pids=()
  for k in 0 1; do
    local net=(--listen "127.0.0.1:$port")
    [ "$k" = 1 ] && net=(--listen 127.0.0.1:0 --initial_peers "127.0.0.1:$port")
    "$BUILD/train_bert" "${common[@]}" --env_type hivemind --train_batch_size 16 --target_batch_size 32 \
      --expected_peers 2 --num_streams 2 --stream_index "$k" --run_id "$1-$$" --average_state_every "$2" \
      --matchmaking_time 5 --averaging_timeout 30 "${net[@]}" --experiment_name "$1$k" --save_dir "$OUT/$1$k" \
      >"$OUT/$1$k.log" 2>&1 &
    pids+=($!)
    [ "$k" = 0 ] && sleep 0.3
  done
  for p in "${pids[@]}"; do wait "$p"; done
}
swarm grads 0
swarm state 1

c=$(median compute); d=$(median ddp); g=$(median grads0); s=$(median state0)
echo "tiny BERT, 2 processes x 1 thread, micro-batch 16, global batch 32, median of steps 3..$STEPS (ms per global step)"
printf "%-44s %8s %10s %10s\n" "" "ms/step" "vs DDP" "over compute"
row() { awk -v n="$1" -v m="$2" -v d="$d" -v c="$c" 'BEGIN{printf "%-44s %8.1f %9.2fx %+9.1f ms\n", n, m, m/d, m-c}'; }
row "compute alone (1 process, batch 16)" "$c"
row "pytorchDDP (Gloo), 2 ranks" "$d"
row "hivemind, gradient round only" "$g"
row "hivemind, gradient + parameter round" "$s"
