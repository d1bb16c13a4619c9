#!/usr/bin/env bash
# CenteredClip against the mean with one poisoning peer: 4 train_bert peers (tiny BERT on the
# corpus, 1 thread each, micro-batch MICRO, dropout off, constant lr 1e-3, disjoint streams), one
# global step per micro-batch of every peer (target 4 x MICRO), STEPS global steps, three runs:
#   clean      4 honest peers, hivemind.aggregation mean
#   mean       peer 3 sends its gradients times FACTOR (POLYTRAIN_HIVEMIND_POISON), aggregation mean
#   clip       the same peer, aggregation centered_clip (its default tau and iterations)
# Prints per run the honest peers' (0-2) final eval loss and last training loss, and each
# poisoned run's eval loss against the clean run's (the goal: centered_clip within 5%, the mean
# far off), with the lines the honest peers printed about the hostile one.
# Usage: bench/hivemind_centered_clip.sh [BUILD_DIR]   (FACTOR=-10, MICRO=16, STEPS=50,
#        OUT=a folder to keep the logs; default a temporary one, removed)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
FACTOR="${FACTOR:--10}"
MICRO="${MICRO:-16}"
STEPS="${STEPS:-50}"
[ -x "$BUILD/train_bert" ] || { echo "error: $BUILD/train_bert not built" >&2; exit 2; }
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; KEEP=1; else OUT="$(mktemp -d /tmp/polytrain_clip.XXXXXX)"; KEEP=0; fi
cleanup() { kill $(jobs -p) 2>/dev/null || true; [ "$KEEP" = 1 ] || rm -rf "$OUT"; }
trap cleanup EXIT
cd "$ROOT"
/usr/bin/python3 - "$OUT" <<'PY'
import json, sys
sys.path.insert(0, "scripts"); from shipped_config import load; c = load("bert_tiny.json")
out = sys.argv[1]
c["model"]["hidden_dropout_prob"] = 0.0
c["model"]["attention_probs_dropout_prob"] = 0.0
c.pop("gradient_accumulation_steps", None)
c.pop("scheduler", None)
c["trainer"].update(num_threads=1, eval_interval=100000, log_interval=1, progress_bar=False,
                    experiments_dir=out + "/exp")
for agg in ("mean", "centered_clip"):
    c["hivemind"] = {"aggregation": agg, "average_state_every": 0}
    json.dump(c, open(f"{out}/{agg}.json", "w"), indent=1)
PY
export OMP_NUM_THREADS=1

# run NAME CONFIG POISONED: four peers for STEPS global steps; peer 3 poisons when POISONED is 1.
run() {
  local name=$1 config=$2 poisoned=$3
  local port
  port=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  local common=(--config "$OUT/$config" --max_steps "$STEPS" --save_interval 0 --env_type hivemind
                --train_batch_size "$MICRO" --train_micro_batch_size_per_gpu "$MICRO" --target_batch_size $((4 * MICRO))
                --num_streams 4 --expected_peers 4 --run_id "clip-$$-$name" --matchmaking_time 5
                --averaging_timeout 30)
  local t0=$SECONDS
  for k in 0 1 2 3; do
    local where=(--listen "127.0.0.1:$port")
    [ "$k" = 0 ] || where=(--listen 127.0.0.1:0 --initial_peers "127.0.0.1:$port")
    local poison=""
    [ "$poisoned" = 1 ] && [ "$k" = 3 ] && poison="$FACTOR"
    POLYTRAIN_HIVEMIND_POISON="$poison" "$BUILD/train_bert" "${common[@]}" --experiment_name "$name$k" \
      --save_dir "$OUT/$name$k" --stream_index "$k" "${where[@]}" > "$OUT/$name$k.log" 2>&1 &
    [ "$k" = 0 ] && sleep 0.3
  done
  wait || true
  echo "$name: $((SECONDS - t0)) s"
}

run clean mean.json 0
run mean mean.json 1
run clip centered_clip.json 1

/usr/bin/python3 - "$OUT" "$FACTOR" <<'PY'
import glob, json, math, sys
out, factor = sys.argv[1], sys.argv[2]
def honest(run):
    evals, last = [], []
    for k in range(3):
        recs = []
        for f in glob.glob(f"{out}/exp/*/{run}{k}/metrics.jsonl"):
            recs += [json.loads(l) for l in open(f)]
        evals += [r["eval_loss"] for r in recs if "eval_loss" in r][-1:]
        last += [r["loss"] for r in recs if "loss" in r and "sent_bytes" in r][-1:]
    mean = lambda v: sum(v) / len(v) if v else float("nan")
    return mean(evals), mean(last), evals
labels = {"clean": "4 honest peers, mean", "mean": f"1 of 4 sends x{factor}, mean",
          "clip": f"1 of 4 sends x{factor}, centered_clip"}
res = {run: honest(run) for run in labels}
for run, label in labels.items():
    e, l, each = res[run]
    rel = "" if run == "clean" else f"  ({100 * (e - res['clean'][0]) / res['clean'][0]:+.1f}% against clean)"
    print(f"{label}: honest peers' eval loss {e:.4f} (each: {', '.join(f'{x:.4f}' for x in each)}), "
          f"last train loss {l:.4f}{rel}")
for k in range(3):
    for line in open(f"{out}/clip{k}.log"):
        if "clipped" in line or "banned" in line or "offence" in line:
            print(f"clip peer {k}: {line.rstrip()}"); break
PY
