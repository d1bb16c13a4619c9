#!/usr/bin/env bash
# What the allocator does to a CPU training step: the same bench_bert_step binary run on
#   tcmalloc        as built (POLYTRAIN_ALLOCATOR=tcmalloc, the default: linked in)
#   glibc tuned     a copy with tcmalloc removed from its libraries (patchelf): glibc's malloc
#                   with the thresholds polytrain raises at start (the fallback)
#   glibc plain     that copy with GLIBC_TUNABLES set, so polytrain leaves glibc as it is
# each in its own process, interleaved, best of ROUNDS; prints ms/step, user/system CPU time
# and peak RSS. Usage: bench/allocator.sh [BUILD_DIR] [tiny|base] [MODE]   (needs patchelf)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
SIZE="${2:-tiny}" MODE="${3:-dense}" ROUNDS="${ROUNDS:-2}"
STEPS=10; [[ $SIZE == base ]] && STEPS=3
command -v patchelf >/dev/null || { echo "allocator: patchelf missing (apt-get install patchelf)" >&2; exit 2; }
unset OMP_NUM_THREADS
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cp "$BUILD/bench_bert_step" "$tmp/bench_glibc"
tc=$(patchelf --print-needed "$tmp/bench_glibc" | grep tcmalloc || true)
[[ -n "$tc" ]] || { echo "allocator: $BUILD/bench_bert_step does not link tcmalloc (POLYTRAIN_ALLOCATOR=system?)" >&2; exit 2; }
patchelf --remove-needed "$tc" "$tmp/bench_glibc"
declare -A ms usr sys rss
run() {  # name, command...
  local name=$1; shift
  local out; out=$( { /usr/bin/env time -f "time %U %S" "$@" "$SIZE" "$STEPS" 0 "$MODE"; } 2>&1)
  local m; m=$(echo "$out" | awk '$1=="ms_per_step"{print $3}')
  if [[ -z "${ms[$name]:-}" ]] || awk -v a="$m" -v b="${ms[$name]}" 'BEGIN{exit !(a<b)}'; then
    ms[$name]=$m; usr[$name]=$(echo "$out" | awk '$1=="time"{print $2}'); sys[$name]=$(echo "$out" | awk '$1=="time"{print $3}')
    rss[$name]=$(echo "$out" | awk '$1=="peak_rss_mb"{print $2}')
  fi
}
[[ -x /usr/bin/time ]] || { echo "allocator: /usr/bin/time missing (apt-get install time)" >&2; exit 2; }
for ((r = 1; r <= ROUNDS; r++)); do
  run tcmalloc "$BUILD/bench_bert_step"
  run "glibc tuned" "$tmp/bench_glibc"
  run "glibc plain" env GLIBC_TUNABLES=glibc.malloc.perturb=0 "$tmp/bench_glibc"
done
echo "BERT $SIZE, $MODE loss, $STEPS steps, polytrain's default threads"
printf "%-12s %10s %9s %8s %8s %12s\n" allocator ms/step "vs plain" "user s" "sys s" "peak RSS MB"
for n in tcmalloc "glibc tuned" "glibc plain"; do
  printf "%-12s %10s %9s %8s %8s %12s\n" "$n" "${ms[$n]}" "$(awk -v a="${ms[$n]}" -v b="${ms[glibc plain]}" 'BEGIN{printf "%.3f", a/b}')" \
    "${usr[$n]}" "${sys[$n]}" "${rss[$n]}"
done
