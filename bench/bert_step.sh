#!/usr/bin/env bash
# Per-step time of polytrain's BERT masked-LM training step (forward + backward + clip + AdamW,
# batch x 128 tokens) against the same model and batch in Python PyTorch (Debian's
# python3-torch 1.13 on the same libtorch), side by side, interleaved, best of ROUNDS per side.
# Columns:
#   python shipped   python3 as installed: glibc malloc, torch's default threads
#   python tuned     PyTorch's CPU performance guide: tcmalloc preloaded, threads = all cores
#   polytrain        what train_bert runs by default: tcmalloc linked in, all cores, the MLM
#                    head only at masked positions (model.sparse_prediction, as NVIDIA's and
#                    Megatron's BERT) and the fused LM loss (no [tokens, vocab] logits)
#   fused only       polytrain with the head at every position (fused loss): less saved work
#   same math        polytrain with the dense loss at every position: the Python side's kernels
#   ratios           step time / tuned Python's (goal <= 0.85)
#   GFLOP/s (peak)   matmul FLOPs each side really runs per second, and that against this
#                    machine's fp32 GEMM rate measured in the same run at the same threads
#                    (bench/gemm_peak.h); for polytrain's default and for the same math
# All of polytrain's variants give the same loss and gradients to float rounding.
# Usage: bench/bert_step.sh [BUILD_DIR]   env: ROUNDS (2), SIZES ("tiny base")
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
ROUNDS="${ROUNDS:-2}"
source "$ROOT/bench/cpu_peer.sh"
echo "CPUs: $(nproc); polytrain's default threads: $threads; fp32 GEMM peak at $threads threads: $gemm GFLOP/s"
echo "BLAS: ${blas:-unknown}; torch (python): $($PY -c 'import torch;print(torch.__version__)'); tuned python preloads $TCMALLOC"
get() { awk -v k="$1" '$1==k{print $NF}'; }
best() { echo "$1 $2" | awk '{print ($2=="" || $1<$2) ? $1 : $2}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.3f", a/b}'; }
printf "%-5s %17s %9s %10s %6s %10s %10s %6s %16s %16s\n" size "python shipped" "tuned" polytrain ratio "fused only" \
  "same math" ratio "GFLOP/s (peak)" "same math"
for spec in ${SIZES:-tiny base}; do
  steps=10; [[ $spec == base ]] && steps=3
  bs=""; bt=""; bo=""; bf=""; bd=""; pyt=""
  for ((round = 1; round <= ROUNDS; round++)); do
    s=$($PY "$ROOT/bench/bert_step_torch.py" "$spec" "$steps" 0)
    pyt=$(echo "$s" | get threads)
    t=$(LD_PRELOAD="$TCMALLOC" $PY "$ROOT/bench/bert_step_torch.py" "$spec" "$steps" "$threads")
    o=$("$BUILD/bench_bert_step" "$spec" "$steps" 0)
    f=$("$BUILD/bench_bert_step" "$spec" "$steps" "$threads" fused)
    d=$("$BUILD/bench_bert_step" "$spec" "$steps" "$threads" dense)
    bs=$(best "$(echo "$s" | get ms_per_step)" "$bs"); bt=$(best "$(echo "$t" | get ms_per_step)" "$bt")
    bo=$(best "$(echo "$o" | get ms_per_step)" "$bo"); bf=$(best "$(echo "$f" | get ms_per_step)" "$bf")
    bd=$(best "$(echo "$d" | get ms_per_step)" "$bd")
    gflop_o=$(echo "$o" | get gflop_per_step); gflop_d=$(echo "$d" | get gflop_per_step)
  done
  rate() { awk -v f="$1" -v ms="$2" -v g="$gemm" 'BEGIN{r = f / (ms / 1000); printf "%.1f (%.0f%%)", r, 100 * r / g}'; }
  printf "%-5s %17s %9s %10s %6s %10s %10s %6s %16s %16s\n" "$spec" "$bs ($pyt thr)" "$bt" "$bo" "$(ratio "$bo" "$bt")" \
    "$bf" "$bd" "$(ratio "$bd" "$bt")" "$(rate "$gflop_o" "$bo")" "$(rate "$gflop_d" "$bd")"
done
