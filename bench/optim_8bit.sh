#!/usr/bin/env bash
# The 8-bit optimizers (src/optim/cpu_optim_8bit.cpp, optimizer.type Adam8bit / AdamW8bit /
# LAMB8bit), two parts:
#  kernels: one 8-bit AdamW step against one fp32 CPU Adam step at 32M parameters, all threads
#    of this machine, with the bytes each moves per step (28 a parameter fp32, 16 8-bit) against
#    a STREAM triad in the same run (bench/bench_optim_8bit.cpp); also each lower kernel forced,
#    and LAMB8bit's two passes (26 bytes a parameter). Target: the 8-bit step faster.
#  models: configs/bert_tiny.json and configs/gpt2_tiny.json as they are (300 steps on the
#    corpus, AdamW) and with optimizer.type AdamW8bit: the final eval loss of each and the
#    ratio (target: within 1%). A seed's four runs take about 7 minutes on the 2-core AMD EPYC
#    of docs/benchmarks.md (gpt2_tiny 3 minutes a run), about 25 on the 2-core Intel Xeon.
# Each kernel figure: median of REPS steps after two warm-up ones.
# Usage: bench/optim_8bit.sh [kernels | models | all] [BUILD_DIR]   (PARAMS=33554432 REPS=9
#        THREADS=all CPUs; for the models STEPS=300, MODELS="bert gpt2", SEEDS="1234 1 2" to
#        run each pair with those trainer seeds instead of the config's, and print the mean ratio:
#        one 8-bit run's final loss moves by a few percent with any perturbation, see
#        docs/benchmarks.md)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHAT="${1:-kernels}"
BUILD="${2:-$ROOT/build}"
PARAMS="${PARAMS:-33554432}"
REPS="${REPS:-9}"
STEPS="${STEPS:-300}"
MODELS="${MODELS:-bert gpt2}"
case "$WHAT" in kernels | models | all) ;; *) echo "usage: $0 [kernels | models | all] [BUILD_DIR]" >&2; exit 2 ;; esac
val() { awk -v k="$1" '$1 == k {print $2}' | tail -1; }
unset OMP_NUM_THREADS MKL_NUM_THREADS  # all threads

if [ "$WHAT" != models ]; then
  B="$BUILD/bench_optim_8bit"
  [ -x "$B" ] || { echo "no $B: build the bench_optim_8bit target first" >&2; exit 1; }
  out=$("$B" "params=$PARAMS" "reps=$REPS" ${THREADS:+"threads=$THREADS"})
  cpu=$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')
  echo "8-bit optimizer kernels, $PARAMS fp32 parameters, $(echo "$out" | val threads) threads, kernel $(echo "$out" | val isa), median of $REPS"
  echo "CPU: $cpu"
  echo "$out" | awk '
    { v[$1] = $2 }
    END {
      bw = v["triad_plain_bytes_per_s"] > v["triad_stream_bytes_per_s"] ? v["triad_plain_bytes_per_s"] : v["triad_stream_bytes_per_s"]
      n = v["params"]
      printf "triad %.2f GB/s (ordinary stores), %.2f GB/s (streaming stores)\n", v["triad_plain_bytes_per_s"]/1e9, v["triad_stream_bytes_per_s"]/1e9
      printf "state: fp32 Adam %.1f MB, 8-bit %.1f MB (%.4f x)\n", v["state_bytes_fp32"]/1e6, v["state_bytes_8bit"]/1e6, v["state_bytes_8bit"]/v["state_bytes_fp32"]
      printf "fp32 CPU Adam (AdamW)  %7.2f ms/step  %5.1f B/param  %6.2f GB/s  %5.1f%% of the triad\n", v["fp32_adamw_s"]*1e3, v["bytes_per_step_fp32"]/n, v["bytes_per_step_fp32"]/v["fp32_adamw_s"]/1e9, 100*v["bandwidth_fraction_fp32"]
      printf "AdamW8bit (%s)     %7.2f ms/step  %5.1f B/param  %6.2f GB/s  %5.1f%% of the triad\n", v["isa"], v["adamw8bit_s"]*1e3, v["bytes_per_step_8bit"]/n, v["bytes_per_step_8bit"]/v["adamw8bit_s"]/1e9, 100*v["bandwidth_fraction_8bit"]
      if ("adamw8bit_avx2_s" in v) printf "AdamW8bit (avx2 forced)   %7.2f ms/step\n", v["adamw8bit_avx2_s"]*1e3
      if ("adamw8bit_scalar_s" in v) printf "AdamW8bit (scalar forced) %7.2f ms/step\n", v["adamw8bit_scalar_s"]*1e3
      printf "LAMB8bit (2 passes)    %7.2f ms/step  %5.1f B/param  %6.2f GB/s  %5.1f%% of the triad\n", v["lamb8bit_s"]*1e3, v["bytes_per_step_lamb8bit"]/n, v["bytes_per_step_lamb8bit"]/v["lamb8bit_s"]/1e9, 100*v["bandwidth_fraction_lamb8bit"]
      printf "fp32 / 8-bit step time  %.2fx  (target > 1; bytes alone would allow %.2fx)\n", v["ratio_fp32_over_8bit"], v["bytes_per_step_fp32"]/v["bytes_per_step_8bit"]
    }'
fi

if [ "$WHAT" != kernels ]; then
  cd "$ROOT"
  TMP="$(mktemp -d /tmp/polytrain_optim_8bit.XXXXXX)"
  trap 'rm -rf "$TMP"' EXIT
  # The last "eval_loss X" a run printed.
  last_eval() { grep -o 'eval_loss [0-9.]*' "$1" | tail -1 | awk '{print $2}'; }
  for model in $MODELS; do
    prog="$BUILD/train_$model"
    [ -x "$prog" ] || { echo "error: $prog not built" >&2; exit 2; }
    ratios=""
    for seed in ${SEEDS:-config}; do
      declare -A loss=()
      for type in AdamW AdamW8bit; do
        /usr/bin/python3 - "${model}_tiny.json" "$type" "$seed" >"$TMP/$model.$type.json" <<'PY'
import json, sys
sys.path.insert(0, "scripts"); from shipped_config import load
c = load(sys.argv[1]); c["optimizer"]["type"] = sys.argv[2]
if sys.argv[3] != "config": c["trainer"]["seed"] = int(sys.argv[3])
print(json.dumps(c))
PY
        start=$(date +%s)
        "$prog" --config "$TMP/$model.$type.json" --max_steps "$STEPS" --eval_interval "$STEPS" --save_interval 0 \
          --log_interval 50 --no_progress_bar --experiments_dir "$TMP/exp" --save_dir "$TMP/ckpt.$model.$type" \
          >"$TMP/$model.$type.log" 2>&1 || { echo "train_$model ($type) failed:"; tail -5 "$TMP/$model.$type.log"; exit 1; }
        loss[$type]=$(last_eval "$TMP/$model.$type.log")
        echo "${model}_tiny $type, seed $seed: eval loss ${loss[$type]} after $STEPS steps ($(( $(date +%s) - start )) s)"
      done
      r=$(awk -v a="${loss[AdamW]}" -v b="${loss[AdamW8bit]}" 'BEGIN { printf "%.4f", b/a }')
      ratios="$ratios $r"
      awk -v m="${model}_tiny" -v s="$seed" -v r="$r" \
        'BEGIN { printf "%s, seed %s: AdamW8bit / AdamW eval loss = %.4f (%+.2f%%; target within 1%%)\n", m, s, r, 100*(r-1) }'
      unset loss
    done
    echo "$ratios" | awk -v m="${model}_tiny" '{ t = 0; for (i = 1; i <= NF; i++) t += $i
      if (NF > 1) printf "%s: mean ratio over %d seeds %.4f (%+.2f%%)\n", m, NF, t/NF, 100*(t/NF-1) }'
  done
fi
