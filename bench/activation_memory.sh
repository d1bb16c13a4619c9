#!/usr/bin/env bash
# Activation checkpointing: peak resident memory and step time of one BERT masked-LM training
# step (forward + backward + clip + AdamW, batch x 128 tokens, 2 threads) with every encoder
# layer checkpointed, against the same run without, each in its own process (same model,
# optimizer and batch: the difference is the activations not kept).
# Usage: bench/activation_memory.sh [BUILD_DIR] [tiny|base] [BATCH_NOTE]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
B="${1:-$ROOT/build}/bench_bert_step"
SIZE="${2:-base}"
STEPS="${STEPS:-3}"
val() { awk -v k="$1" '$1 == k {print $NF}'; }
plain=$("$B" "$SIZE" "$STEPS" 2 default)
ckpt=$("$B" "$SIZE" "$STEPS" 2 checkpoint)
awk -v pm="$(echo "$plain" | val peak_rss_mb)" -v cm="$(echo "$ckpt" | val peak_rss_mb)" \
    -v pt="$(echo "$plain" | val ms_per_step)" -v ct="$(echo "$ckpt" | val ms_per_step)" -v s="$SIZE" 'BEGIN {
  printf "BERT %s, %s steps: peak RSS plain %.0f MB, checkpointed %.0f MB (%.0f MB less, ratio %.3f)\n", s, ENVIRON["STEPS"] ? ENVIRON["STEPS"] : 3, pm, cm, pm - cm, cm / pm
  printf "step time plain %.0f ms, checkpointed %.0f ms (ratio %.3f; checkpointing adds one forward of each layer, fewer allocations can hide it on CPU)\n", pt, ct, ct / pt
}'
