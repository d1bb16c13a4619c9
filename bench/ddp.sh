#!/usr/bin/env bash
# pytorchDDP benchmarks on this machine (2 cores), every figure with its comparison:
#  (a) weak scaling: samples/s per rank, 2 ranks x 1 thread vs 1 rank x 1 thread (target >= 0.9);
#  (b) share of all-reduce time hidden behind backward: 1 - exposed wait with overlap /
#      exposed wait without overlap (all buckets reduced after backward), same run otherwise;
#  (c) all_reduce bus bandwidth of each CPU communicator vs this machine's memcpy bandwidth, and
#      the ceiling: a single-copy shared-memory all-reduce by 2 threads, measured the same way;
#  (d) step time vs Python PyTorch DDP over gloo (Debian's python3-torch 1.13), same model,
#      batch and threads (target <= 0.9x); ours as launched (one host: over MPI), over gloo as
#      Python, and over gloo with the dense LM loss Python computes.
# Usage: bench/ddp.sh [BUILD_DIR]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
L="$BUILD/launch"
B="$BUILD/bench_ddp"
STEPS="${STEPS:-10}"
MICRO="${MICRO:-8}"
export OMP_NUM_THREADS=1
val() { awk -v k="$1" 'index($1, k) == 1 {print $NF}' | tail -1; }
run() { "$L" --master_port $((29600 + RANDOM % 300)) "$@" 2>/dev/null | sed 's/^\[rank 0\] //'; }
blas=$(update-alternatives --query libblas.so.3-x86_64-linux-gnu 2>/dev/null | awk '/^Value:/{print $2}')
echo "BLAS: ${blas:-unknown}; 1 thread per rank; micro-batch $MICRO x 128 tokens per rank; $STEPS steps"

echo "== (a) weak scaling (tiny BERT, fused LM loss)"
s1=$(run --num_gpus 1 "$B" step "$STEPS" "$MICRO" | val samples_per_s_per_rank)
s2=$(run --num_gpus 2 "$B" step "$STEPS" "$MICRO" | val samples_per_s_per_rank)
awk -v a="$s1" -v b="$s2" 'BEGIN{printf "1 rank: %.2f samples/s; 2 ranks: %.2f samples/s per rank; efficiency %.3f (target >= 0.9)\n", a, b, b/a}'

echo "== (b) all-reduce hidden behind backward (2 ranks)"
for bucket in 25000000 1000000; do
  on=$(run --num_gpus 2 "$B" step "$STEPS" "$MICRO" bucket_bytes=$bucket)
  off=$(run --num_gpus 2 "$B" step "$STEPS" "$MICRO" bucket_bytes=$bucket no_overlap)
  e_on=$(echo "$on" | val exposed_comm_ms); e_off=$(echo "$off" | val exposed_comm_ms); nb=$(echo "$on" | val buckets)
  awk -v a="$e_on" -v b="$e_off" -v n="$nb" -v s="$bucket" 'BEGIN{printf "bucket %d B (%d buckets): exposed all-reduce %.2f ms/step with overlap, %.2f ms without; hidden %.1f%%\n", s, n, a, b, 100*(1-a/b)}'
done

echo "== (c) all_reduce bus bandwidth (2 ranks)"
echo "-- launch as is (one host: its ranks are an MPI job through launch's PMIx server; auto picks mpi)"
run --num_gpus 2 "$B" comm
echo "-- the same, MPI all-reduces whole instead of in 2 MiB segments (POLYTRAIN_MPI_SEGMENT_BYTES=0)"
POLYTRAIN_MPI_SEGMENT_BYTES=0 run --num_gpus 2 "$B" comm
echo "-- launch --no_mpi_world (auto picks gloo)"
run --num_gpus 2 --no_mpi_world "$B" comm
if command -v mpirun >/dev/null; then
  echo "-- launch --launcher openmpi (through mpirun)"
  "$L" --launcher openmpi --num_gpus 2 "$B" comm 2>/dev/null | grep -v '^$' || true
fi
# The hardware's ceiling for the same all-reduces: 2 threads averaging slices of 2 buffers in
# one address space (each byte read and written once; no engine can do better here).
"$B" ceiling 2

echo "== (d) step time vs Python DDP over gloo (2 ranks x 1 thread)"
ours=$(run --num_gpus 2 "$B" step "$STEPS" "$MICRO" | val ms_per_step)
gloo=$(run --num_gpus 2 --no_mpi_world "$B" step "$STEPS" "$MICRO" | val ms_per_step)
dense=$(run --num_gpus 2 --no_mpi_world "$B" step "$STEPS" "$MICRO" dense | val ms_per_step)
py=$(/usr/bin/python3 "$ROOT/bench/ddp_step_torch.py" "$STEPS" "$MICRO" 2>/dev/null | val ms_per_step)
awk -v a="$ours" -v g="$gloo" -v d="$dense" -v p="$py" 'BEGIN{printf "ours as launched (mpi) %.1f ms (ratio %.3f), ours over gloo %.1f ms (ratio %.3f), ours over gloo with the dense LM loss %.1f ms (ratio %.3f), Python DDP %.1f ms; target <= 0.9\n", a, a/p, g, g/p, d, d/p, p}'
