#!/usr/bin/env bash
# The launcher's plan at scale: `launch --dry_run` on hostfiles of 1,000 / 3,000 / 10,000
# hosts x 8 slots through each multi-node runner (ssh: one command per host; pdsh: one
# command for all; openmpi: mpirun + a generated hostfile): wall time, peak memory (GNU
# time's max RSS) and bytes printed. Side by side, the launcher of commit $BEFORE (default
# 402b4aa, before the per-node commands stopped carrying the whole world), built here from
# git (it is torch-free: seconds), on the sizes it can finish; and the floor: `cat` writing
# as many bytes as the new plan printed. Goal (issue 14): 10,000 x 8 in <= 2 s, <= 200 MB,
# growing linearly (the time ratio 10k/1k near 10, not 100).
# Usage: bench/launch_plan.sh [BUILD_DIR]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
BEFORE="${BEFORE:-402b4aa}"
[ -x "$BUILD/launch" ] || { echo "error: $BUILD/launch not built (cmake --build $BUILD --target launch)" >&2; exit 2; }
TMP="$(mktemp -d /tmp/polytrain_launch_plan.XXXXXX)"
trap 'rm -rf "$TMP"' EXIT

# The old launcher, from git, compiled with the same flags the build uses for it.
old=""
if git -C "$ROOT" cat-file -e "$BEFORE^{commit}" 2>/dev/null; then
  mkdir -p "$TMP/old/src/polytrain"
  git -C "$ROOT" archive "$BEFORE" src/launcher src/common | tar -x -C "$TMP/old"
  ln -s ../launcher "$TMP/old/src/polytrain/launcher"
  ln -s ../common "$TMP/old/src/polytrain/common"
  if g++ -std=gnu++17 -O2 -I"$TMP/old/src" "$TMP"/old/src/launcher/*.cpp "$TMP/old/src/common/main_guard.cpp" \
      $( [ -f "$TMP/old/src/common/error.cpp" ] && echo "$TMP/old/src/common/error.cpp") -o "$TMP/launch_old" 2>"$TMP/old.log"; then
    old="$TMP/launch_old"
  else
    echo "(the launcher of $BEFORE did not build here: $(head -c 300 "$TMP/old.log"))"
  fi
fi

measure() {  # LAUNCH HOSTS RUNNER -> "seconds maxrss_kb bytes"
  local bin=$1 hosts=$2 runner=$3
  /usr/bin/time -f "%e %M" -o "$TMP/time" "$bin" --hostfile "$TMP/hosts_$hosts" --launcher "$runner" --dry_run \
    train_bert --config configs/bert_tiny.json >"$TMP/out" 2>/dev/null
  echo "$(cat "$TMP/time") $(stat -c %s "$TMP/out")"
}

for hosts in 1000 3000 10000; do
  awk -v n="$hosts" 'BEGIN{for (i = 0; i < n; i++) printf "worker-%d slots=8\n", i}' >"$TMP/hosts_$hosts"
done
printf "%-8s %-7s %12s %12s %12s   %s\n" runner hosts "new s" "new MB" "printed MB" "before: s, MB"
declare -A T
for runner in ssh pdsh openmpi; do
  for hosts in 1000 3000 10000; do
    read -r s kb bytes < <(measure "$BUILD/launch" "$hosts" "$runner")
    T[$runner$hosts]=$s
    before="-"
    if [ -n "$old" ] && [ "$hosts" -le 3000 ]; then
      read -r os okb _ < <(measure "$old" "$hosts" "$runner")
      before="$os s, $((okb / 1024)) MB"
    fi
    printf "%-8s %-7s %12s %12s %12.1f   %s\n" "$runner" "$hosts" "$s" "$((kb / 1024))" "$(echo "$bytes" | awk '{print $1/1e6}')" "$before"
  done
  if [ "$runner" = ssh ]; then
    head -c "$bytes" /dev/zero >"$TMP/floor"
    f=$( { /usr/bin/time -f "%e" cat "$TMP/floor" >/dev/null; } 2>&1 )
    echo "  floor: cat of the same $((bytes / 1000000)) MB: $f s"
  fi
done
for runner in ssh pdsh openmpi; do
  awk -v r="$runner" -v a="${T[${runner}1000]}" -v b="${T[${runner}10000]}" \
    'BEGIN{printf "%s: 10,000 hosts %.2f s (goal <= 2 s); time 10k/1k = %.1f (linear: ~10, quadratic: ~100)\n", r, b, (a > 0 ? b / a : 0)}'
done
