#!/usr/bin/env bash
# A swarm on this machine (env_type hivemind): N train_bert peers (default 4) started the way
# volunteers start them (no launcher: the first peer's address is the others' --initial_peers),
# training tiny BERT on the corpus with target_batch_size 64, each peer on its own shuffled
# stream. Prints every peer's loss lines as they come; logs stay in $OUT (default a temp dir).
# With LATE=S, one more peer joins S seconds after the others started: it loads the swarm's
# state from the peers (its log says from how many) and trains on with them.
# Usage: [LATE=20] scripts/swarm_demo.sh [PEERS] [extra train_bert flags, e.g. --max_steps 40]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD_DIR:-$ROOT/build}"
PEERS="${1:-4}"
shift || true
cd "$ROOT"
[ -x "$BUILD/train_bert" ] || { echo "error: $BUILD/train_bert not built (bash scripts/setup.sh builds it)" >&2; exit 2; }
OUT="${OUT:-$(mktemp -d /tmp/polytrain_swarm.XXXXXX)}"
PORT="${PORT:-31337}"
RUN="demo-$$"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM
for ((k = 0; k < PEERS; k++)); do
  if ((k == 0)); then net=(--listen "127.0.0.1:$PORT"); else net=(--listen 127.0.0.1:0 --initial_peers "127.0.0.1:$PORT"); fi
  OMP_NUM_THREADS=1 "$BUILD/train_bert" --config configs/bert_tiny_hivemind.json --run_id "$RUN" "${net[@]}" \
    --expected_peers "$PEERS" --experiments_dir "$OUT/exp" --experiment_name "peer$k" --save_dir "$OUT/peer$k" --no_progress_bar "$@" \
    >"$OUT/peer$k.log" 2>&1 &
  pids+=($!)
  ((k == 0)) && sleep 1
done
echo "swarm of $PEERS peers (run '$RUN'), logs in $OUT; the peers' loss lines:"
[ -n "${LATE:-}" ] && : >"$OUT/peer$PEERS.log"  # followed from the start
tail -q -n +1 -F "${OUT}"/peer*.log 2>/dev/null | grep --line-buffered -E '^step|hivemind|error' &
tailer=$!
if [ -n "${LATE:-}" ]; then
  sleep "$LATE"
  echo "a late peer joins (peer$PEERS)"
  OMP_NUM_THREADS=1 "$BUILD/train_bert" --config configs/bert_tiny_hivemind.json --run_id "$RUN" \
    --listen 127.0.0.1:0 --initial_peers "127.0.0.1:$PORT" --experiments_dir "$OUT/exp" --experiment_name "peer$PEERS" \
    --save_dir "$OUT/peer$PEERS" --no_progress_bar "$@" >"$OUT/peer$PEERS.log" 2>&1 &
  pids+=($!)
fi
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done
kill "$tailer" 2>/dev/null || true
pids=()
echo "swarm finished (exit $status); logs in $OUT"
exit "$status"
