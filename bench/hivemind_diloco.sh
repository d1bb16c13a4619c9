#!/usr/bin/env bash
# Local updates (hivemind.outer_optimizer, DiLoCo) against per-step averaging, at the same samples
# swarm-wide: 3 train_bert peers (tiny BERT on the corpus, 1 thread each, micro-batch MICRO, dropout
# off, constant lr 1e-3) read disjoint streams. Per-step averaging: target 3 x MICRO (every peer
# averages its gradient after each micro-batch; compression BASE_CODEC, gradient rounds only).
# Local updates: target 3 x H x MICRO (H inner AdamW steps per peer, then one round of the
# pseudo-gradients in CODEC and the outer Nesterov step, lr 0.7, momentum 0.9). Both runs see
# STEPS x 3 x MICRO samples. Prints per run: bytes per sample (sent + received, summed over the
# peers' metrics.jsonl), the eval loss at the end (each peer's, on the same held-out batches), and
# the training loss curve against samples.
# Usage: bench/hivemind_diloco.sh [BUILD_DIR]   (H=8, CODEC=uint8, BASE_CODEC=none, MICRO=16, STEPS=96,
#        MODES="per_step local" (either alone for a sweep), OUT=a folder to keep the logs; default a
#        temporary one, removed)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
H="${H:-8}"
CODEC="${CODEC:-uint8}"
BASE_CODEC="${BASE_CODEC:-none}"
MICRO="${MICRO:-16}"
STEPS="${STEPS:-96}"
MODES="${MODES:-per_step local}"
[ -x "$BUILD/train_bert" ] || { echo "error: $BUILD/train_bert not built" >&2; exit 2; }
[ $((STEPS % H)) -eq 0 ] || { echo "error: STEPS ($STEPS) must be a multiple of H ($H)" >&2; exit 2; }
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; KEEP=1; else OUT="$(mktemp -d /tmp/polytrain_diloco.XXXXXX)"; KEEP=0; fi
cleanup() { kill $(jobs -p) 2>/dev/null || true; [ "$KEEP" = 1 ] || rm -rf "$OUT"; }
trap cleanup EXIT
cd "$ROOT"
/usr/bin/python3 - "$OUT" "$CODEC" "$BASE_CODEC" <<'PY'
import json, sys
sys.path.insert(0, "scripts"); from shipped_config import load; c = load("bert_tiny.json")
out, codec, base_codec = sys.argv[1:4]
c["model"]["hidden_dropout_prob"] = 0.0
c["model"]["attention_probs_dropout_prob"] = 0.0
c.pop("gradient_accumulation_steps", None)
c.pop("scheduler", None)
c["trainer"].update(num_threads=1, eval_interval=100000, log_interval=1, progress_bar=False,
                    experiments_dir=out + "/exp")
c["hivemind"] = {"compression": base_codec, "average_state_every": 0}
json.dump(c, open(out + "/per_step.json", "w"), indent=1)
c["hivemind"] = {"compression": codec,
                 "outer_optimizer": {"type": "nesterov", "params": {"lr": 0.7, "momentum": 0.9}}}
json.dump(c, open(out + "/local.json", "w"), indent=1)
PY
export OMP_NUM_THREADS=1

# run NAME CONFIG TARGET GLOBAL_STEPS: three peers until GLOBAL_STEPS global steps.
run() {
  local name=$1 config=$2 target=$3 steps=$4
  local port
  port=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  local common=(--config "$OUT/$config" --max_steps "$steps" --save_interval 0 --env_type hivemind
                --train_batch_size "$MICRO" --train_micro_batch_size_per_gpu "$MICRO" --target_batch_size "$target"
                --num_streams 3 --expected_peers 3 --run_id "diloco-$$-$name" --matchmaking_time 10
                --averaging_timeout 60)
  local t0=$SECONDS
  for k in 0 1 2; do
    local where=(--listen "127.0.0.1:$port")
    [ "$k" = 0 ] || where=(--listen 127.0.0.1:0 --initial_peers "127.0.0.1:$port")
    "$BUILD/train_bert" "${common[@]}" --experiment_name "$name$k" --save_dir "$OUT/$name$k" --stream_index "$k" \
      "${where[@]}" > "$OUT/$name$k.log" 2>&1 &
    [ "$k" = 0 ] && sleep 0.3
  done
  wait
  echo "$name: $((SECONDS - t0)) s"
}

case " $MODES " in *" per_step "*) run per_step per_step.json $((3 * MICRO)) "$STEPS" ;; esac
case " $MODES " in *" local "*) run local local.json $((3 * H * MICRO)) $((STEPS / H)) ;; esac

/usr/bin/python3 - "$OUT" "$H" "$CODEC" "$BASE_CODEC" "$MICRO" "$MODES" <<'PY'
import glob, json, sys
out, h, codec, base_codec, micro = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
modes = sys.argv[6].split()
def records(name):
    recs = []
    for f in glob.glob(f"{out}/exp/*/{name}/metrics.jsonl"):
        recs += [json.loads(l) for l in open(f)]
    return recs
summary = {}
for run in modes:
    traffic = samples = 0
    evals, curve = [], {}
    for k in range(3):
        recs = records(f"{run}{k}")
        steps = [r for r in recs if "sent_bytes" in r]
        traffic += sum(r["sent_bytes"] + r["received_bytes"] for r in steps)
        samples += max(r["contributed_samples"] for r in steps)
        evals += [r["eval_loss"] for r in recs if "eval_loss" in r][-1:]
        for r in steps:
            curve.setdefault(r["step"], []).append(r["loss"])
    per = traffic / samples
    final = sum(evals) / len(evals)
    summary[run] = (per, final)
    label = f"per-step averaging ({base_codec})" if run == "per_step" else f"local updates (H = {h}, {codec})"
    print(f"{label}: {per:,.0f} bytes per sample, {samples} samples, final eval loss {final:.4f} "
          f"(peers: {', '.join(f'{e:.4f}' for e in evals)})")
    step_samples = 3 * micro * (1 if run == "per_step" else h)
    pts = sorted(curve)
    every = max(1, len(pts) // 12)
    print("  train loss by samples swarm-wide: " + ", ".join(
        f"{s * step_samples}: {sum(curve[s]) / len(curve[s]):.3f}" for s in pts[::every] + ([pts[-1]] if pts[-1] not in pts[::every] else [])))
if len(summary) < 2:
    sys.exit(0)
(pb, pl), (lb, ll) = summary["per_step"], summary["local"]
print(f"local updates: {pb / lb:.1f}x fewer bytes per sample, final eval loss {100 * (ll - pl) / pl:+.1f}% against per-step averaging")
PY
