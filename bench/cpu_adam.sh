#!/usr/bin/env bash
# The CPU Adam kernel (src/optim/cpu_adam.cpp, what ZeRO offload steps its fp32 partitions
# with) at 32M fp32 parameters, all threads of this machine, every figure with its comparison:
#  (a) ours, AdamW mode, in parameter updates/s; also with the fused bf16 copy-out;
#  (b) torch::optim::AdamW::step on one 32M tensor, as is (target: ours >= 5x);
#  (c) the same with glibc's mmap / trim thresholds raised to 1 GiB, so that its per-step
#      temporaries stop costing page faults, in a process of its own (target: ours >= 2.5x);
#  (d) a STREAM triad in the same run: its bytes/s / 28 bytes a parameter (read p, g, m, v;
#      write p, m, v) is the bandwidth limit (target: ours >= 60% of it);
#  (e) the same 28-byte access pattern without Adam's arithmetic, the tighter reference where
#      seven streams outrun the triad's three (see bench/bench_cpu_adam.cpp).
# Each figure: median of REPS repetitions after two warm-up ones.
# Usage: bench/cpu_adam.sh [BUILD_DIR]   (PARAMS=33554432 REPS=9 by default)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
B="$BUILD/bench_cpu_adam"
PARAMS="${PARAMS:-33554432}"
REPS="${REPS:-9}"
[ -x "$B" ] || { echo "no $B: build the bench_cpu_adam target first" >&2; exit 1; }
unset OMP_NUM_THREADS MKL_NUM_THREADS  # all threads, for libtorch and for us
val() { awk -v k="$1" '$1 == k {print $2}' | tail -1; }

main=$("$B" all "params=$PARAMS" "reps=$REPS")
raised=$("$B" torch raised "params=$PARAMS" "reps=$REPS")
threads=$(echo "$main" | val threads)
isa=$(echo "$main" | val isa)
triad_plain=$(echo "$main" | val triad_plain_bytes_per_s)
triad_stream=$(echo "$main" | val triad_stream_bytes_per_s)
limit=$(echo "$main" | val limit_updates_per_s)
traffic=$(echo "$main" | val traffic7_updates_per_s)
ours=$(echo "$main" | val ours_updates_per_s)
ours_bf16=$(echo "$main" | val ours_bf16_updates_per_s)
torch=$(echo "$main" | val torch_adamw_updates_per_s)
torch_raised=$(echo "$raised" | val torch_adamw_raised_updates_per_s)

echo "CPU Adam, $PARAMS fp32 parameters, $threads threads, kernel $isa, median of $REPS"
awk -v tp="$triad_plain" -v ts="$triad_stream" -v l="$limit" -v t7="$traffic" 'BEGIN{
  printf "(d) triad %.2f GB/s (ordinary stores), %.2f GB/s (streaming stores): limit %.3g updates/s at 28 B each\n", tp/1e9, ts/1e9, l
  printf "(e) same traffic, no Adam math: %.3g updates/s (%.2f GB/s)\n", t7, t7*28/1e9}'
awk -v o="$ours" -v ob="$ours_bf16" -v t="$torch" -v tr="$torch_raised" -v l="$limit" -v t7="$traffic" 'BEGIN{
  printf "(a) ours %.3g updates/s (%.2f GB/s); with bf16 copy-out %.3g updates/s\n", o, o*28/1e9, ob
  printf "(b) torch AdamW as is %.3g updates/s\n", t
  printf "(c) torch AdamW, glibc thresholds raised %.3g updates/s\n", tr
  printf "ours / torch as is           %7.2fx  (target >= 5)\n", o/t
  printf "ours / torch thresholds up   %7.2fx  (target >= 2.5)\n", o/tr
  printf "ours / bandwidth limit (d)   %7.1f%%  (target >= 60%%)\n", 100*o/l
  printf "ours bf16 / limit at 30 B    %7.1f%%\n", 100*ob/(l*28/30)
  printf "ours / same traffic (e)      %7.1f%%\n", 100*o/t7}'
