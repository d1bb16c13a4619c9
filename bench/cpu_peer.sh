# Sourced by bench/bert_step.sh and bench/gpt2_step.sh (BUILD set): what both compare against.
#   PY        Debian's python3 with python3-torch (the peer)
#   TCMALLOC  the tcmalloc the tuned peer preloads (PyTorch's CPU performance guide)
#   threads   polytrain's default thread count here (OMP_NUM_THREADS unset: all the CPUs)
#   gemm      this machine's fp32 GEMM rate at those threads, GFLOP/s (bench/gemm_peak.h)
#   blas      the libblas.so.3 that Debian's alternatives select
#   machine   the CPU (vendor, family, model, ISA, bf16 units) and the BLAS kernel, printed first
PY=/usr/bin/python3
TCMALLOC=$(ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 2>/dev/null | head -1)
[[ -n "$TCMALLOC" ]] || { echo "$(basename "$0"): libtcmalloc_minimal.so.4 missing (apt-get install libgoogle-perftools-dev)" >&2; exit 2; }
unset OMP_NUM_THREADS
# Both sides on the BLAS kernel this machine gets by itself (polytrain's choice, the first line
# names it): an OPENBLAS_CORETYPE left in the environment would force it on both (KEEP_BLAS_ENV=1
# keeps it).
[[ "${KEEP_BLAS_ENV:-0}" == 1 ]] || unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
_peak=$("$BUILD/bench_bert_step" gemm 0 0)
threads=$(echo "$_peak" | awk '$1=="threads"{print $2}')
gemm=$(echo "$_peak" | awk '$1=="gemm_gflops"{print $2}')
blas=$(update-alternatives --query libblas.so.3-x86_64-linux-gnu 2>/dev/null | awk '/^Value:/{print $2}')
machine=$("$BUILD/bench_bert_step" cpu 0 0 | grep -E '^(cpu|blas) ')
echo "$machine"
