#!/usr/bin/env bash
# A long run's resources (issue 14): tiny BERT for STEPS steps (default 2,000) on the corpus,
# a checkpoint every 50 with keep_last 2 and an evaluation every 200, sampled every second:
# resident memory (VmRSS), open file descriptors, threads, and the disk used by the save
# directory. Prints the samples' first and last values, the RSS slope after warm-up
# (least squares over the second half, KB per 1,000 steps), the largest fd and thread counts,
# and the largest disk use against what keep_last allows (2 checkpoints, the best one by eval
# loss, and one being written). The samples stay in $SAMPLES when it is set.
# Usage: bench/long_run.sh [STEPS] [BUILD_DIR]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STEPS="${1:-2000}"
BUILD="${2:-$ROOT/build}"
cd "$ROOT"
[ -x "$BUILD/train_bert" ] || { echo "error: $BUILD/train_bert not built" >&2; exit 2; }
TMP="$(mktemp -d /tmp/polytrain_long_run.XXXXXX)"
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$TMP"' EXIT
/usr/bin/python3 -c 'import json, sys; sys.path.insert(0, "scripts"); from shipped_config import load
c = load("bert_tiny.json"); c["trainer"]["keep_last"] = 2; print(json.dumps(c))' >"$TMP/config.json"
"$BUILD/train_bert" --config "$TMP/config.json" --max_steps "$STEPS" --save_interval 50 \
  --eval_interval 200 --log_interval 10 --save_dir "$TMP/ckpt" --experiments_dir "$TMP/exp" --no_progress_bar \
  >"$TMP/log" 2>&1 &
pid=$!
: >"$TMP/samples"  # seconds step rss_kb fds threads disk_kb
start=$(date +%s.%N)
while kill -0 "$pid" 2>/dev/null; do
  rss=$(awk '/^VmRSS/{print $2}' "/proc/$pid/status" 2>/dev/null || true)
  thr=$(awk '/^Threads/{print $2}' "/proc/$pid/status" 2>/dev/null || true)
  fds=$(ls "/proc/$pid/fd" 2>/dev/null | wc -l || true)
  disk=$(du -sk "$TMP/ckpt" 2>/dev/null | awk '{print $1}' || true)
  step=$(grep -o '^step [0-9]*' "$TMP/log" 2>/dev/null | tail -1 | awk '{print $2}' || true)
  now=$(date +%s.%N)
  [ -n "$rss" ] && echo "$(awk -v a="$start" -v b="$now" 'BEGIN{printf "%.1f", b-a}') ${step:-0} $rss $fds $thr ${disk:-0}" >>"$TMP/samples"
  sleep 1
done
wait "$pid" && rc=0 || rc=$?
pid=""
[ -n "${SAMPLES:-}" ] && cp "$TMP/samples" "$SAMPLES"
[ "$rc" = 0 ] || { echo "train_bert failed (exit $rc):"; tail -5 "$TMP/log"; exit 1; }
ckpt_kb=$(du -sk "$(ls -d "$TMP"/ckpt/global_step* | tail -1)" | awk '{print $1}')
kept=$(ls -d "$TMP"/ckpt/global_step* | wc -l)
best=$([ -d "$TMP/ckpt/best" ] && echo 1 || echo 0)
awk -v steps="$STEPS" -v ck="$ckpt_kb" -v kept="$kept" -v best="$best" '
  { t[NR]=$1; s[NR]=$2; r[NR]=$3; f[NR]=$4; th[NR]=$5; d[NR]=$6
    if ($4 > fmax) fmax=$4; if ($5 > tmax) tmax=$5; if ($6 > dmax) dmax=$6 }
  END {
    n = NR; h = int(n / 2) + 1; sx = sy = sxx = sxy = m = 0
    for (i = h; i <= n; i++) { if (s[i] == 0) continue; m++; sx += s[i]; sy += r[i]; sxx += s[i]*s[i]; sxy += s[i]*r[i] }
    slope = (m > 2 && m*sxx - sx*sx > 0) ? (m*sxy - sx*sy) / (m*sxx - sx*sx) * 1000 : 0
    printf "%d steps, %d samples over %.0f s\n", steps, n, t[n]
    # Resident memory by quarter of the run (the largest sample in each): flat means no growth
    # after the first quarter of warm-up (allocator pools, the first evaluation).
    for (q = 1; q <= 4; q++) { lo = int((q - 1) * n / 4) + 1; hi = int(q * n / 4); qm[q] = 0
      for (i = lo; i <= hi; i++) if (r[i] > qm[q]) qm[q] = r[i] }
    printf "RSS: %.1f MB at step %d, %.1f MB at step %d; largest by quarter of the run: %.1f / %.1f / %.1f / %.1f MB\n", r[2]/1024, s[2], r[n]/1024, s[n], qm[1]/1024, qm[2]/1024, qm[3]/1024, qm[4]/1024
    printf "RSS slope over the second half: %.1f MB per 1000 steps (least squares over %d samples)\n", slope/1024, m
    printf "fds: first %d, last %d, max %d; threads: first %d, last %d, max %d\n", f[2], f[n], fmax, th[2], th[n], tmax
    bound = (kept + best + 1) * ck
    printf "disk: max %.1f MB; one checkpoint %.1f MB, %d kept at the end (keep_last 2) + %d best: bound (%d + %d + 1 being written) x %.1f = %.1f MB\n", dmax/1024, ck/1024, kept, best, kept, best, ck/1024, bound/1024
  }' "$TMP/samples"
