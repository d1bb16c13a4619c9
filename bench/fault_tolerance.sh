#!/usr/bin/env bash
# Fault tolerance against checkpoint-restart on the same job (tiny BERT, 3 pytorchDDP ranks over
# Gloo on this machine, 12 samples a step), one rank SIGKILLed after step FAIL_AT:
#  (a) uninterrupted: the reference wall time;
#  (b) --fault_tolerance: the survivors regroup and redo the step (docs/fault_tolerance.md);
#  (c) --max_restarts 1 with a checkpoint every SAVE_EVERY steps: the whole group restarts from
#      the last checkpoint (the steps since it are redone, plus start-up and loading).
# Lost seconds = wall time - (a)'s. Also prints the worst relative loss difference of (b) to (a).
# Usage: bench/fault_tolerance.sh [BUILD_DIR]   (STEPS, FAIL_AT, SAVE_EVERY in the environment)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
STEPS="${STEPS:-40}"
FAIL_AT="${FAIL_AT:-13}"
SAVE_EVERY="${SAVE_EVERY:-8}"
export OMP_NUM_THREADS=1
OUT="$(mktemp -d /tmp/pt_bench_ft_XXXXXX)"
trap 'rm -rf "$OUT"' EXIT
PYTHONPATH="$ROOT/scripts" python3 - "$OUT/config.json" <<'PY'
import json, sys
import shipped_config
c = shipped_config.load("bert_tiny.json")
c["data"]["max_seq_length"] = 64
c["trainer"]["comm_timeout"] = 10
json.dump(c, open(sys.argv[1], "w"))
PY
now() { date +%s.%N; }
# run NAME ENV LAUNCH_FLAGS PROGRAM_FLAGS: wall seconds; the log in $OUT/NAME.txt
run() {
  local t0 t1
  t0=$(now)
  env $2 "$BUILD/launch" --num_gpus 3 --master_port $((29600 + RANDOM % 300)) $3 "$BUILD/train_bert" \
    --config "$OUT/config.json" --env_type pytorchDDP --max_steps "$STEPS" --train_batch_size 12 \
    --train_micro_batch_size_per_gpu 2 --log_interval 1 --eval_interval 100000 --no_progress_bar --num_threads 1 \
    --experiments_dir "$OUT/$1" $4 > "$OUT/$1.txt" 2>&1 || { echo "$1 failed:"; tail -5 "$OUT/$1.txt"; exit 1; }
  t1=$(now)
  awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b - a}'
}
losses() { grep -h '"loss"' "$OUT"/$1/*/*/metrics.jsonl | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    if "lr" in r: print(r["step"], repr(r["loss"]))'; }
fault="POLYTRAIN_FAULT=2:step:$FAIL_AT:KILL"
echo "$STEPS steps, rank 2 of 3 SIGKILLed after step $FAIL_AT; checkpoint-restart saves every $SAVE_EVERY steps"
a=$(run plain "" "" "")
b=$(run ft "$fault" "" "--fault_tolerance")
c=$(run restart "$fault" "--max_restarts 1" "--save_interval $SAVE_EVERY --save_dir $OUT/ckpt --load_dir $OUT/ckpt")
lost_line=$(grep -o 'redone over the same [0-9]* samples; [0-9.]* s lost' "$OUT/ft.txt" || true)
worst=$(join <(losses plain) <(losses ft) | awk '{d = ($2 - $3) / $2; if (d < 0) d = -d; if (d > w) w = d} END{printf "%.2g", w}')
printf "%-34s %8s %8s\n" "run" "wall s" "lost s"
printf "%-34s %8s %8s\n" "(a) uninterrupted" "$a" "-"
printf "%-34s %8s %8s\n" "(b) --fault_tolerance" "$b" "$(awk -v x="$b" -v y="$a" 'BEGIN{printf "%.1f", x - y}')"
printf "%-34s %8s %8s\n" "(c) --max_restarts, save every $SAVE_EVERY" "$c" "$(awk -v x="$c" -v y="$a" 'BEGIN{printf "%.1f", x - y}')"
echo "(b) says: ${lost_line:-no membership line}; worst relative loss difference to (a): $worst"
