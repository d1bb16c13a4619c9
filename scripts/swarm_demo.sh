#!/usr/bin/env bash
# A swarm on this machine (env_type hivemind): a monitor peer (hivemind_monitor, no model) and
# N peers (default 4; train_bert on configs/bert_tiny_hivemind.json, or PROGRAM on CONFIG)
# started the way volunteers start them (no launcher: the monitor's address is everyone's
# --initial_peers), training a tiny model on the corpus with target_batch_size 64, each peer on its own shuffled stream. Prints the monitor's line per
# global step (the swarm's loss, alive peers, samples, samples/s); the monitor also writes
# $OUT/monitor/metrics.jsonl, TensorBoard events and a checkpoint every 10 steps in
# $OUT/monitor_ckpt (loadable with --load_dir). Logs stay in $OUT (default a temp dir).
# With LATE=S, one more peer joins S seconds after the others started: it loads the swarm's
# state from the peers (its log says from how many) and trains on with them.
# Usage: [LATE=20] [PROGRAM=train_gpt2 CONFIG=configs/gpt2_tiny_hivemind.json] scripts/swarm_demo.sh [PEERS]
#        [extra flags of the training program, e.g. --max_steps 40]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD_DIR:-$ROOT/build}"
PEERS="${1:-4}"
PROGRAM="${PROGRAM:-train_bert}"
CONFIG="${CONFIG:-configs/bert_tiny_hivemind.json}"
shift || true
cd "$ROOT"
for b in "$PROGRAM" hivemind_monitor; do
  [ -x "$BUILD/$b" ] || { echo "error: $BUILD/$b not built (cmake --build $BUILD --target $b)" >&2; exit 2; }
done
OUT="${OUT:-$(mktemp -d /tmp/polytrain_swarm.XXXXXX)}"
mkdir -p "$OUT"
PORT="${PORT:-31337}"
RUN="demo-$$"
pids=()
monitor=""
cleanup() {
  for p in "${pids[@]}" $monitor; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM
"$BUILD/hivemind_monitor" --run_id "$RUN" --listen "127.0.0.1:$PORT" --log_dir "$OUT/monitor" \
  --save_dir "$OUT/monitor_ckpt" --save_every 10 >"$OUT/monitor.log" 2>&1 &
monitor=$!
sleep 1
net=(--listen 127.0.0.1:0 --initial_peers "127.0.0.1:$PORT")
for ((k = 0; k < PEERS; k++)); do
  OMP_NUM_THREADS=1 "$BUILD/$PROGRAM" --config "$CONFIG" --run_id "$RUN" "${net[@]}" \
    --expected_peers "$PEERS" --experiments_dir "$OUT/exp" --experiment_name "peer$k" --save_dir "$OUT/peer$k" --no_progress_bar "$@" \
    >"$OUT/peer$k.log" 2>&1 &
  pids+=($!)
done
echo "swarm of $PEERS peers and a monitor (run '$RUN'), logs in $OUT; the monitor's lines:"
tail -n +1 -F "$OUT/monitor.log" 2>/dev/null &
tailer=$!
if [ -n "${LATE:-}" ]; then
  sleep "$LATE"
  echo "a late peer joins (peer$PEERS)"
  OMP_NUM_THREADS=1 "$BUILD/$PROGRAM" --config "$CONFIG" --run_id "$RUN" \
    --listen 127.0.0.1:0 --initial_peers "127.0.0.1:$PORT" --experiments_dir "$OUT/exp" --experiment_name "peer$PEERS" \
    --save_dir "$OUT/peer$PEERS" --no_progress_bar "$@" >"$OUT/peer$PEERS.log" 2>&1 &
  pids+=($!)
fi
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done
pids=()
kill -TERM "$monitor" 2>/dev/null || true  # the monitor logs what is pending and saves, then exits
wait "$monitor" || status=$?
monitor=""
sleep 0.2
kill "$tailer" 2>/dev/null || true
echo "swarm finished (exit $status); logs in $OUT"
exit "$status"
