#!/usr/bin/env bash
# The `amp` levels on CPU in bf16 (issue 16, item 5), side by side in one run: train_bert on the
# corpus with polytrain's defaults (all cores, tcmalloc), fp32 (no precision block), bf16
# autocast ("bf16": {"enabled": true}), and amp O1 / O2 / O3 with "dtype": "bfloat16".
# For each: ms per step (the mean over the second half of the steps, from the trainer's log),
# peak RSS (GNU time), the loss at the last step, and the model's weight / gradient /
# optimizer-state bytes per parameter as the level lays them out.
# Usage: bench/amp_cpu.sh [BUILD_DIR]   env: SIZE (base | tiny; base = BERT-base, 12 x 768,
#        micro-batch 8 x 128 tokens), STEPS (8 for base, 40 for tiny)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
SIZE="${SIZE:-base}"
STEPS="${STEPS:-$([[ $SIZE == base ]] && echo 8 || echo 40)}"
cd "$ROOT"
unset OMP_NUM_THREADS
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$BUILD/bench_bert_step" cpu 0 0 | grep -E '^(cpu|blas) '
echo "CPU bf16 flags: $(grep -o -w 'avx512_bf16\|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')| $(nproc) CPUs | BERT $SIZE, $STEPS steps"
printf "%-6s %10s %8s %12s %10s  %s\n" level ms/step "vs fp32" "peak RSS MB" "last loss" "bytes/param (weights+grads+master+Adam)"
for level in fp32 bf16 O1 O2 O3; do
  /usr/bin/python3 - "$SIZE" "$level" "$STEPS" "$tmp/$level.json" <<'PY'
import json, sys
size, level, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
sys.path.insert(0, "scripts"); from shipped_config import load; c = load("bert_tiny.json")
if size == "base":
    c["model"].update(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
    c["train_batch_size"] = c["train_micro_batch_size_per_gpu"] = 8
c["trainer"].update(max_steps=steps, log_interval=steps // 2, eval_interval=0, save_interval=0)
if level == "bf16":
    c["bf16"] = {"enabled": True}
elif level != "fp32":
    c["amp"] = {"enabled": True, "opt_level": level, "dtype": "bfloat16"}
json.dump(c, open(out, "w"))
PY
  /usr/bin/time -f "%M" -o "$tmp/$level.rss" "$BUILD/train_bert" --config "$tmp/$level.json" --no_progress_bar \
    --experiments_dir "$tmp/exp" > "$tmp/$level.log"
  ms=$(awk '/^step /{for(i=1;i<=NF;i++) if($i=="ms/step") v=$(i-1)} END{print v}' "$tmp/$level.log")
  loss=$(awk '/^step /{for(i=1;i<=NF;i++) if($i=="loss" && $(i+1)!="scale") v=$(i+1)} END{print v}' "$tmp/$level.log")
  [[ $level == fp32 ]] && base_ms=$ms
  case $level in fp32|bf16|O1) bytes="4+4+0+8 = 16";; O2) bytes="2+2+4+8 = 16, +4 fp32 gradient during the update";; O3) bytes="2+2+0+4 = 8";; esac
  printf "%-6s %10s %8s %12s %10s  %s\n" "$level" "$ms" "$(awk -v a="$ms" -v b="$base_ms" 'BEGIN{printf "%.3f", a/b}')" \
    "$(awk '{printf "%.0f", $1/1024}' "$tmp/$level.rss")" "$loss" "$bytes"
done
grep -h "^amp O" "$tmp"/O*.log | sort -u
