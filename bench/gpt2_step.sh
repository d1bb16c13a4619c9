#!/usr/bin/env bash
# GPT-2 small (124M) forward + backward tokens/s (dropout off, no optimizer step): polytrain
# against the same model and batch in Python PyTorch (Debian's python3-torch 1.13 on the same
# libtorch; the model of scripts/hf_ref/gpt2.py, transformers' math), interleaved, best of
# ROUNDS per side, with peak resident memory.
# Rows:
#   python shipped       python3 as installed: glibc malloc, torch's default threads
#   python tuned         tcmalloc preloaded, threads = all cores (PyTorch's CPU guide)
#   polytrain            what train_gpt2 runs by default: tcmalloc linked in, all cores, fused
#                        LM loss (no [tokens, 50257] logits)
#   same math            polytrain with the dense logits of the Python side
#   ATen's GEMM          polytrain's default with POLYTRAIN_GEMM=aten: ATen's own fp32 matmul
#                        kernels (OpenBLAS, bmm one product at a time) instead of src/ops/cpu_gemm
#   + checkpointing      polytrain's default with every block recomputed in backward
# "vs tuned" is tokens/s over tuned Python's (goal >= 1.2); "of GEMM peak" is the matmul FLOPs
# per second against this machine's fp32 GEMM measured in the same run (bench/gemm_peak.h).
# Last, one layer's attention forward + backward: the eager ops against the fused causal kernel.
# Usage: bench/gpt2_step.sh [BUILD_DIR]   env: BATCH (4), SEQ (256), STEPS (3), ROUNDS (2)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
BATCH="${BATCH:-4}" SEQ="${SEQ:-256}" STEPS="${STEPS:-3}" ROUNDS="${ROUNDS:-2}"
source "$ROOT/bench/cpu_peer.sh"
echo "GPT-2 small, batch $BATCH x $SEQ tokens; CPUs: $(nproc); polytrain's default threads: $threads; fp32 GEMM peak: $gemm GFLOP/s"
echo "BLAS: ${blas:-unknown}; torch (python): $($PY -c 'import torch;print(torch.__version__)'); tuned python preloads $TCMALLOC"
get() { awk -v k="$1" '$1==k{print $NF}'; }
best() { echo "$1 $2" | awk '{print ($2=="" || $1>$2) ? $1 : $2}'; }
declare -A tok rss thr
run_side() {  # name, command...
  local name=$1; shift
  local out; out=$("$@")
  tok[$name]=$(best "$(echo "$out" | get tokens_per_s)" "${tok[$name]:-}")
  rss[$name]=$(echo "$out" | get peak_rss_mb); thr[$name]=$(echo "$out" | get threads)
  local g; g=$(echo "$out" | get gflop_per_step)
  if [[ -n "$g" ]]; then gflop=$g; fi
}
for ((round = 1; round <= ROUNDS; round++)); do
  run_side shipped $PY "$ROOT/bench/gpt2_step_torch.py" small "$STEPS" 0 "$BATCH" "$SEQ"
  run_side tuned env LD_PRELOAD="$TCMALLOC" $PY "$ROOT/bench/gpt2_step_torch.py" small "$STEPS" "$threads" "$BATCH" "$SEQ"
  run_side ours "$BUILD/bench_gpt2_step" small "$STEPS" 0 "$BATCH" "$SEQ"
  run_side dense "$BUILD/bench_gpt2_step" small "$STEPS" "$threads" "$BATCH" "$SEQ" dense
  run_side atengemm env POLYTRAIN_GEMM=aten "$BUILD/bench_gpt2_step" small "$STEPS" 0 "$BATCH" "$SEQ"
done
run_side ckpt "$BUILD/bench_gpt2_step" small "$STEPS" 0 "$BATCH" "$SEQ" checkpoint
printf "%-34s %8s %10s %9s %13s %12s\n" side threads tokens/s "vs tuned" "of GEMM peak" "peak RSS MB"
row() {
  local t=${tok[$2]}
  local pct; pct=$(awk -v t="$t" -v f="$gflop" -v b="$BATCH" -v s="$SEQ" -v g="$gemm" 'BEGIN{printf "%.0f%%", 100 * f * t / (b * s) / g}')
  printf "%-34s %8s %10s %9s %13s %12s\n" "$1" "${thr[$2]}" "$t" "$(awk -v a="$t" -v b="${tok[tuned]}" 'BEGIN{printf "%.3f", a/b}')" \
    "$pct" "${rss[$2]}"
}
row "python shipped (dense logits)" shipped
row "python tuned (dense logits)" tuned
row "polytrain (fused LM loss)" ours
row "polytrain, same math (dense)" dense
row "polytrain, ATen's GEMM" atengemm
row "polytrain + checkpointing" ckpt
# One layer's attention alone (the fused causal kernel the default runs, against the eager ops).
"$BUILD/bench_gpt2_step" small 10 0 "$BATCH" "$SEQ" attention
