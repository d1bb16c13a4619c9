#!/usr/bin/env bash
# Per-step time of polytrain's BERT masked-LM step against the same model, batch and thread
# count in Python PyTorch (Debian's python3-torch 1.13, same libtorch), side by side; prints
# the ratio (ours / Python's; targets: tiny <= 0.85, base <= 1.0) and the BLAS in use.
# "ours" is what train_bert runs by default (model.fused_lm_loss: the LM loss and its gradients
# computed chunk by chunk, without the [tokens, vocab] logits). "dense" is polytrain with
# fused_lm_loss off: the very kernels the Python side runs, so its ratio isolates the
# interpreter overhead. "masked-only" adds model.sparse_prediction (head transform only at
# masked positions). All three give the same loss and gradients to float rounding.
# Usage: bench/bert_step.sh [BUILD_DIR]   (needs python3-torch: apt-get install python3-torch)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
THREADS="${THREADS:-2}"
PY=/usr/bin/python3
blas=$(update-alternatives --query libblas.so.3-x86_64-linux-gnu 2>/dev/null | awk '/^Value:/{print $2}')
echo "BLAS: ${blas:-unknown}; threads: $THREADS; torch (python): $($PY -c 'import torch;print(torch.__version__)')"
ms() { awk '/^ms_per_step/{print $3}'; }
printf "%-6s %10s %10s %7s %10s %7s %16s\n" size "ours ms" "python ms" ratio "dense ms" ratio "masked-only ms"
for spec in "tiny 10" "base 3"; do
  set -- $spec
  # Interleave the two sides twice and keep each side's best: the machine is noisy.
  best_c=""; best_p=""; best_m=""; best_d=""
  for round in 1 2; do
    c=$("$BUILD/bench_bert_step" "$1" "$2" "$THREADS" | ms)
    d=$("$BUILD/bench_bert_step" "$1" "$2" "$THREADS" dense | ms)
    p=$($PY "$ROOT/bench/bert_step_torch.py" "$1" "$2" "$THREADS" | ms)
    m=$("$BUILD/bench_bert_step" "$1" "$2" "$THREADS" masked_only | ms)
    best_c=$(echo "$c $best_c" | awk '{print ($2=="" || $1<$2) ? $1 : $2}')
    best_p=$(echo "$p $best_p" | awk '{print ($2=="" || $1<$2) ? $1 : $2}')
    best_m=$(echo "$m $best_m" | awk '{print ($2=="" || $1<$2) ? $1 : $2}')
    best_d=$(echo "$d $best_d" | awk '{print ($2=="" || $1<$2) ? $1 : $2}')
  done
  ratio=$(awk -v a="$best_c" -v b="$best_p" 'BEGIN{printf "%.3f", a/b}')
  dratio=$(awk -v a="$best_d" -v b="$best_p" 'BEGIN{printf "%.3f", a/b}')
  printf "%-6s %10s %10s %7s %10s %7s %16s\n" "$1" "$best_c" "$best_p" "$ratio" "$best_d" "$dratio" "$best_m"
done
