#!/usr/bin/env bash
# Wall time from starting the launcher to 8 local workers (/bin/true) started and exited:
# polytrain's `launch` side by side with torchrun (python3 -m torch.distributed.run, Debian's
# python3-torch 1.13). Best of 5 each, interleaved. Target: launch <= 0.25x torchrun.
# Usage: bench/launch_startup.sh [BUILD_DIR]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
t() { local s e; s=$(date +%s%N); "$@" >/dev/null 2>&1; e=$(date +%s%N); awk -v a="$s" -v b="$e" 'BEGIN{print (b-a)/1e9}'; }
best_l=""; best_t=""
for i in 1 2 3 4 5; do
  l=$(t "$BUILD/launch" --num_gpus 8 --master_port $((29700 + i)) --no_local_rank /bin/true)
  p=$(t /usr/bin/python3 -m torch.distributed.run --nproc_per_node 8 --master_port $((29710 + i)) --no_python /bin/true)
  best_l=$(echo "$l $best_l" | awk '{print ($2=="" || $1<$2) ? $1 : $2}')
  best_t=$(echo "$p $best_t" | awk '{print ($2=="" || $1<$2) ? $1 : $2}')
done
awk -v a="$best_l" -v b="$best_t" 'BEGIN{printf "8 workers /bin/true: launch %.1f ms, torchrun %.1f ms, ratio %.3f (target <= 0.25)\n", a*1000, b*1000, a/b}'
