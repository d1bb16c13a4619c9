#!/usr/bin/env bash
# bf16 autocast on CPU against fp32 (issue 16, item 3), in one run:
#  (1) step time, polytrain's defaults otherwise (all cores, tcmalloc): BERT tiny and base
#      (forward + backward + clip + AdamW) and GPT-2 small (forward + backward), fp32 then bf16
#      (the forward under CPU autocast in bf16, weights and optimizer state fp32: what
#      "bf16": {"enabled": true} runs), interleaved, best of ROUNDS;
#  (2) the loss curve: train_bert (configs/bert_tiny.json) and train_gpt2 (configs/gpt2_tiny.json)
#      for STEPS steps on the corpus in fp32 and in bf16, logged every 20 steps, with the largest
#      gap between the two curves and the final evaluation loss of each.
# Prints the CPU's bf16 flags and the ATen CPU capability (Debian's libtorch caps ATen's own
# kernels at AVX2; matmuls go to oneDNN, which uses AVX512_BF16 where the CPU has it).
# Usage: bench/bf16_cpu.sh [BUILD_DIR]   env: ROUNDS (2), STEPS (300)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
ROUNDS="${ROUNDS:-2}" STEPS="${STEPS:-300}"
cd "$ROOT"
unset OMP_NUM_THREADS
echo "CPU bf16 flags: $(grep -o -w 'avx512_bf16\|amx_bf16\|avx512f' /proc/cpuinfo | sort -u | tr '\n' ' ')"
/usr/bin/python3 -c 'import torch; print("ATen", [l.strip() for l in torch.__config__.show().splitlines() if "CPU capability" in l][0])' 2>/dev/null || true
get() { awk -v k="$1" '$1==k{print $NF}'; }
best() { echo "$1 $2" | awk '{print ($2=="" || $1<$2) ? $1 : $2}'; }
echo "== (1) step time, ms (best of $ROUNDS)"
printf "%-14s %10s %10s %8s\n" model fp32 bf16 ratio
for spec in "bert tiny 10" "bert base 3" "gpt2 small 2"; do
  set -- $spec
  f=""; b=""
  for ((r = 1; r <= ROUNDS; r++)); do
    for mode in default bf16; do
      if [[ $1 == bert ]]; then out=$("$BUILD/bench_bert_step" "$2" "$3" 0 "$mode"); else out=$("$BUILD/bench_gpt2_step" "$2" "$3" 0 4 256 "$mode"); fi
      ms=$(echo "$out" | get ms_per_step)
      if [[ $mode == default ]]; then f=$(best "$ms" "$f"); else b=$(best "$ms" "$b"); fi
    done
  done
  printf "%-14s %10s %10s %8s\n" "$1 $2" "$f" "$b" "$(awk -v a="$b" -v c="$f" 'BEGIN{printf "%.3f", a/c}')"
done
echo "== (2) loss over $STEPS steps (log every 20), fp32 vs bf16"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
for prog in bert gpt2; do
  cfg=configs/bert_tiny.json; [[ $prog == gpt2 ]] && cfg=configs/gpt2_tiny.json
  for p in fp32 bf16; do
    flag=(); [[ $p == bf16 ]] && flag=(--bf16)
    s=$(date +%s.%N)
    "$BUILD/train_$prog" --config "$cfg" "${flag[@]}" --max_steps "$STEPS" --log_interval 20 --eval_interval "$STEPS" \
      --save_interval 0 --no_progress_bar --experiments_dir "$tmp/exp" > "$tmp/$prog.$p.log"
    echo "$prog $p: $(awk -v s="$s" 'BEGIN{"date +%s.%N" | getline e; printf "%.1f", e - s}') s" >> "$tmp/times"
  done
  paste <(awk '/^step /{for(i=1;i<=NF;i++) if($i=="loss") print $(i+1)}' "$tmp/$prog.fp32.log") \
        <(awk '/^step /{for(i=1;i<=NF;i++) if($i=="loss") print $(i+1)}' "$tmp/$prog.bf16.log") > "$tmp/pairs"
  ev() { awk '/^eval step/{for(i=1;i<=NF;i++) if($i=="eval_loss") v=$(i+1)} END{print v}' "$1"; }
  awk -v n="$prog" -v ef="$(ev "$tmp/$prog.fp32.log")" -v eb="$(ev "$tmp/$prog.bf16.log")" '
    {d = $2 - $1; if (d < 0) d = -d; if (d > m) {m = d; at = NR * 20}; lf = $1; lb = $2}
    END {printf "%s: last logged loss fp32 %.4f bf16 %.4f; largest gap %.4f (step %d); eval loss fp32 %s bf16 %s\n", n, lf, lb, m, at, ef, eb}' "$tmp/pairs"
done
cat "$tmp/times"
