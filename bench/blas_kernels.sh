#!/usr/bin/env bash
# Which BLAS kernel this machine should run, by the numbers, in one run: the fp32 GEMM rate
# (at::mm, 1024^3, all cores) with OpenBLAS's own pick (what polytrain runs by default, after its
# kernel choice), then each OpenBLAS kernel forced with OPENBLAS_CORETYPE (Prescott = the SSE3
# fall-back an unknown CPU gets, Haswell = AVX2, SkylakeX and Cooperlake = AVX-512), and BLIS
# (Debian's libblis4-openmp, dispatching by CPU features) where installed, and oneDNN's sgemm (the
# engine src/ops/cpu_gemm.cpp picks where the CPU has AVX-512); with the cores' fp32 FMA peak, the
# bf16 GEMM rate through oneDNN and the AMX bf16 peak measured in the same run. A second table:
# the same engines over GPT-2 124M's matmuls (bench/gemm_peak.h, gpt2_matmul_gflops), the figure
# that decides polytrain's default engine (POLYTRAIN_GEMM).
# Usage: bench/blas_kernels.sh [BUILD_DIR]   env: ROUNDS (2)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
ROUNDS="${ROUNDS:-2}"
unset OMP_NUM_THREADS
# Each row forces its own kernel; the rest (the peaks, the engine table) runs on the kernel this
# machine gets by itself, not on one left in the environment.
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
get() { awk -v k="$1" '$1==k{print $2}'; }
best() { echo "$1 $2" | awk '{print ($2=="" || $1>$2) ? $1 : $2}'; }
p=$(env -u OPENBLAS_CORETYPE "$BUILD/bench_bert_step" peaks 0 0)
echo "$p" | grep -E '^(threads|cpu|blas) '
peak=$(echo "$p" | get fp32_peak_gflops)
echo "fp32 FMA peak: $(echo "$p" | awk '$1=="fp32_peak_gflops"{$1=""; print}') GFLOP/s"
echo "bf16 GEMM (oneDNN): $(echo "$p" | get bf16_gemm_gflops) GFLOP/s; AMX bf16 peak: $(echo "$p" | get amx_bf16_peak_gflops) GFLOP/s"
blis=""
for d in /usr/lib/x86_64-linux-gnu/blis-openmp /usr/lib/x86_64-linux-gnu/blis-pthread; do
  [[ -e $d/libblas.so.3 ]] && { blis=$d; break; }
done
printf "%-26s %12s %10s\n" "fp32 GEMM on" "GFLOP/s" "of peak"
# Every BLAS row runs ATen's own matmul kernels (POLYTRAIN_GEMM=aten) on that BLAS.
for name in default Prescott Haswell SkylakeX Cooperlake ${blis:+BLIS} oneDNN; do
  r=""
  for ((i = 0; i < ROUNDS; i++)); do
    case $name in
      default) out=$(env -u OPENBLAS_CORETYPE POLYTRAIN_GEMM=aten "$BUILD/bench_bert_step" gemm 0 0) ;;
      BLIS) out=$(LD_LIBRARY_PATH="$blis${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" POLYTRAIN_GEMM=aten "$BUILD/bench_bert_step" gemm 0 0) ;;
      oneDNN) out=$(POLYTRAIN_GEMM=onednn "$BUILD/bench_bert_step" gemm 0 0) ;;
      *) out=$(OPENBLAS_CORETYPE=$name POLYTRAIN_GEMM=aten "$BUILD/bench_bert_step" gemm 0 0) ;;
    esac
    r=$(best "$(echo "$out" | get gemm_gflops)" "$r")
  done
  label=$name; [[ $name == default ]] && label="default ($(echo "$p" | sed -n 's/^blas .*\[kernel \([^,]*\),.*/\1/p'))"
  printf "%-26s %12s %9s%%\n" "$label" "$r" "$(awk -v a="$r" -v b="$peak" 'BEGIN{printf "%.0f", 100 * a / b}')"
done
echo "GPT-2 124M's matmuls (1024 tokens: the layers' forward and both gradients, an LM-head block, attention as bmm):"
printf "%-44s %12s %10s\n" "POLYTRAIN_GEMM" "GFLOP/s" "of peak"
default_engine=$(echo "$p" | get gemm_engine)
for engine in aten blas onednn; do
  r=""
  for ((i = 0; i < ROUNDS; i++)); do
    r=$(best "$(POLYTRAIN_GEMM=$engine "$BUILD/bench_bert_step" gpt2_matmuls 0 0 | get gemm_gflops)" "$r")
  done
  label=$engine
  case $engine in
    aten) label="aten (OpenBLAS, bmm one product at a time)" ;;
    blas) label="blas (OpenBLAS, bmm over the batch)" ;;
    onednn) label="onednn (oneDNN sgemm, bmm over the batch)" ;;
  esac
  [[ $engine == "$default_engine" ]] && label="$label *"
  printf "%-44s %12s %9s%%\n" "$label" "$r" "$(awk -v a="$r" -v b="$peak" 'BEGIN{printf "%.0f", 100 * a / b}')"
done
echo "* polytrain's default on this machine"
