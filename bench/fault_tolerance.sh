#!/usr/bin/env bash
# Fault tolerance against checkpoint-restart on the same job (tiny BERT, 3 pytorchDDP ranks over
# Gloo on this machine, 12 samples a step), one rank SIGKILLed after step FAIL_AT:
#  (a) uninterrupted: the reference wall time;
#  (b) --fault_tolerance: the survivors regroup and redo the step (docs/fault_tolerance.md);
#  (c) --max_restarts 1 with a checkpoint every SAVE_EVERY steps: the whole group restarts from
#      the last checkpoint (the steps since it are redone, plus start-up and loading);
#  (d) --fault_tolerance --max_restarts 1: as (b), and launch restarts the lost rank alone, which
#      rejoins at a step boundary with rank 0's live state (the group grows back to 3).
# Lost seconds = wall time - (a)'s. Also prints the worst relative loss difference of (b) to (a).
# EVERY=N instead kills a rank from outside every N steps (ranks 2, 1, 2, 1, ... as rank 0's log
# reaches steps N, 2N, ...; at most 2 failures in (b), whose group only shrinks), and (c) and (d)
# get --max_restarts as large as the failures: lost seconds per failure.
# Usage: bench/fault_tolerance.sh [BUILD_DIR]   (STEPS, FAIL_AT, SAVE_EVERY, EVERY in the environment)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
STEPS="${STEPS:-40}"
FAIL_AT="${FAIL_AT:-13}"
SAVE_EVERY="${SAVE_EVERY:-8}"
EVERY="${EVERY:-0}"
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
# killer NAME MAX: SIGKILLs rank 2, 1, 2, ... of run NAME (its train_bert process, found by RANK
# in its environment) each time rank 0's log passes EVERY more steps, MAX times at most.
killer() {
  local name=$1 max=$2 next=$EVERY r=2 n=0 s p
  while ((n < max)); do
    sleep 0.2
    [[ -f "$OUT/$name.txt" ]] || continue
    s=$(grep -o '\[rank 0\] step [0-9]*/' "$OUT/$name.txt" | tr -d '/' | awk '$4 > m {m = $4} END{print m + 0}')
    ((s >= STEPS)) && return
    ((s < next)) && continue
    for p in $(pgrep -f "train_bert.*$OUT/$name( |$)"); do
      if tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "RANK=$r"; then kill -9 "$p" && break; fi
    done
    n=$((n + 1)); next=$((next + EVERY)); r=$((3 - r))
  done
}
# run NAME ENV LAUNCH_FLAGS PROGRAM_FLAGS [KILLS]: wall seconds; the log in $OUT/NAME.txt
run() {
  local t0 t1 k=""
  t0=$(now)
  if [[ -n "${5:-}" ]]; then killer "$1" "$5" & k=$!; fi
  env $2 "$BUILD/launch" --num_gpus 3 --master_port $((29600 + RANDOM % 300)) $3 "$BUILD/train_bert" \
    --config "$OUT/config.json" --env_type pytorchDDP --max_steps "$STEPS" --train_batch_size 12 \
    --train_micro_batch_size_per_gpu 2 --log_interval 1 --eval_interval 100000 --no_progress_bar --num_threads 1 \
    --experiments_dir "$OUT/$1" $4 > "$OUT/$1.txt" 2>&1 || { echo "$1 failed:"; tail -5 "$OUT/$1.txt"; exit 1; }
  t1=$(now)
  [[ -n "$k" ]] && { kill "$k" 2>/dev/null || true; wait "$k" 2>/dev/null || true; }
  awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b - a}'
}
losses() { grep -h '"loss"' "$OUT"/$1/*/*/metrics.jsonl | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    if "lr" in r: print(r["step"], repr(r["loss"]))'; }
if ((EVERY > 0)); then
  kills=$(((STEPS - 1) / EVERY))
  echo "$STEPS steps, a rank of 3 SIGKILLed from outside every $EVERY steps ($kills failures; 2 in (b));" \
    "checkpoint-restart saves every $SAVE_EVERY steps"
  a=$(run plain "" "" "")
  b=$(run ft "" "" "--fault_tolerance" $((kills < 2 ? kills : 2)))
  c=$(run restart "" "--max_restarts $kills" "--save_interval $SAVE_EVERY --save_dir $OUT/ckpt --load_dir $OUT/ckpt" "$kills")
  d=$(run replace "" "--max_restarts $kills" "--fault_tolerance" "$kills")
else
  fault="POLYTRAIN_FAULT=2:step:$FAIL_AT:KILL"
  echo "$STEPS steps, rank 2 of 3 SIGKILLed after step $FAIL_AT; checkpoint-restart saves every $SAVE_EVERY steps"
  a=$(run plain "" "" "")
  b=$(run ft "$fault" "" "--fault_tolerance")
  c=$(run restart "$fault" "--max_restarts 1" "--save_interval $SAVE_EVERY --save_dir $OUT/ckpt --load_dir $OUT/ckpt")
  d=$(run replace "$fault" "--max_restarts 1" "--fault_tolerance")
fi
lost_line=$(grep -o 'redone over the same [0-9]* samples; [0-9.]* s lost' "$OUT/ft.txt" | tr '\n' ' ' || true)
join_line=$(grep -o 'rank [0-9] joined at step [0-9]* ([^)]*)' "$OUT/replace.txt" | sed 's/ (.*//' | tr '\n' ' ' || true)
echo "(d) membership changes: $(cat "$OUT"/replace/*/*/metrics.jsonl 2>/dev/null | grep -c 'membership_change' || true)"
worst_of() { join <(losses plain) <(losses "$1") | awk '{d = ($2 - $3) / $2; if (d < 0) d = -d; if (d > w) w = d} END{printf "%.2g", w}'; }
worst=$(worst_of ft)
printf "%-34s %8s %8s\n" "run" "wall s" "lost s"
printf "%-34s %8s %8s\n" "(a) uninterrupted" "$a" "-"
printf "%-34s %8s %8s\n" "(b) --fault_tolerance" "$b" "$(awk -v x="$b" -v y="$a" 'BEGIN{printf "%.1f", x - y}')"
printf "%-34s %8s %8s\n" "(c) --max_restarts, save every $SAVE_EVERY" "$c" "$(awk -v x="$c" -v y="$a" 'BEGIN{printf "%.1f", x - y}')"
printf "%-34s %8s %8s\n" "(d) --fault_tolerance --max_restarts" "$d" "$(awk -v x="$d" -v y="$a" 'BEGIN{printf "%.1f", x - y}')"
echo "(b) says: ${lost_line:-no membership line}; worst relative loss difference to (a): $worst"
echo "(d) says: ${join_line:-no join line}; worst relative loss difference to (a): $(worst_of replace)"
