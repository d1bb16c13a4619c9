#!/usr/bin/env bash
# A peer that joins a running swarm late: how many rounds it misses (each one a state reload)
# before it takes part. Two trainer peers (tiny BERT, 1 thread each, micro-batch 16, target
# 48) and a client-mode peer started DELAY seconds later, 20 global steps, RUNS times. On this
# 2-core machine the late peer's micro-batch takes about as long as the trainers' whole global
# step, which can lock it one epoch behind: it loads epoch e, computes, finds e's round over,
# loads e+1, and so on.
# Usage: bench/hivemind_late_peer.sh [BUILD_DIR]   (RUNS=3, DELAY=4)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
RUNS="${RUNS:-3}"
DELAY="${DELAY:-4}"
[ -x "$BUILD/train_bert" ] || { echo "error: $BUILD/train_bert not built" >&2; exit 2; }
OUT="$(mktemp -d /tmp/polytrain_late_peer.XXXXXX)"
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$OUT"' EXIT
cd "$ROOT"
/usr/bin/python3 - "$OUT" <<'PY'
import json, sys
sys.path.insert(0, "scripts"); from shipped_config import load; c = load("bert_tiny.json")
c["model"]["hidden_dropout_prob"] = 0.0
c["model"]["attention_probs_dropout_prob"] = 0.0
c.pop("gradient_accumulation_steps", None)
c["trainer"].update(num_threads=1, eval_interval=100000, log_interval=1, progress_bar=False,
                    experiments_dir=sys.argv[1] + "/exp")
json.dump(c, open(sys.argv[1] + "/config.json", "w"), indent=1)
PY
export OMP_NUM_THREADS=1
for run in $(seq 1 "$RUNS"); do
  port=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  common=(--config "$OUT/config.json" --max_steps 20 --save_interval 0 --env_type hivemind --train_batch_size 16
          --train_micro_batch_size_per_gpu 16 --target_batch_size 48 --num_streams 3 --run_id "late-$$-$run"
          --matchmaking_time 10 --averaging_timeout 30)
  "$BUILD/train_bert" "${common[@]}" --experiment_name p0 --save_dir "$OUT/p0" --stream_index 0 --expected_peers 2 \
    --listen "127.0.0.1:$port" > "$OUT/p0.log" 2>&1 &
  sleep 0.3
  "$BUILD/train_bert" "${common[@]}" --experiment_name p1 --save_dir "$OUT/p1" --stream_index 1 --expected_peers 2 \
    --listen 127.0.0.1:0 --initial_peers "127.0.0.1:$port" > "$OUT/p1.log" 2>&1 &
  sleep "$DELAY"
  "$BUILD/train_bert" "${common[@]}" --experiment_name late --save_dir "$OUT/late" --stream_index 2 --client_mode \
    --listen 127.0.0.1:0 --initial_peers "127.0.0.1:$port" > "$OUT/late.log" 2>&1 &
  wait
  joined=$(grep -o "joining a swarm at epoch [0-9]*" "$OUT/late.log" | grep -o "[0-9]*$" || echo "?")
  missed=$(grep -c "ended without this peer" "$OUT/late.log" || true)
  rounds=$(grep -c "| group 3" "$OUT/p0.log" || true)
  echo "run $run: the late peer loaded the state at epoch $joined, then missed $missed round(s) (a reload each); it took part in $rounds of 20 rounds"
  rm -rf "$OUT/exp" "$OUT/p0" "$OUT/p1" "$OUT/late"
done
