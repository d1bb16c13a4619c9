#!/usr/bin/env bash
# GPT-2 small (124M) forward + backward tokens/s: polytrain against the same model, batch and
# thread count in Python PyTorch (Debian's python3-torch, same libtorch), side by side, plus
# peak resident memory with and without activation checkpointing.
# "ours" is what train_gpt2 runs (fused LM loss: no [tokens, 50257] logits); "dense" materialises
# the logits as the Python side does, so its ratio isolates everything but the loss.
# Usage: bench/gpt2_step.sh [BUILD_DIR]   env: THREADS (2), BATCH (4), SEQ (256), STEPS (3)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
THREADS="${THREADS:-2}" BATCH="${BATCH:-4}" SEQ="${SEQ:-256}" STEPS="${STEPS:-3}"
PY=/usr/bin/python3
blas=$(update-alternatives --query libblas.so.3-x86_64-linux-gnu 2>/dev/null | awk '/^Value:/{print $2}')
echo "GPT-2 small, batch $BATCH x $SEQ tokens, $THREADS threads; BLAS: ${blas:-unknown}; torch (python): $($PY -c 'import torch;print(torch.__version__)')"
get() { awk -v k="$1" '$1==k{print $2}'; }
best() { echo "$1 $2" | awk '{print ($2=="" || $1>$2) ? $1 : $2}'; }
ours=""; dense=""; py=""
for round in 1 2; do  # interleaved, best of two per side: the machine is noisy
  o=$("$BUILD/bench_gpt2_step" small "$STEPS" "$THREADS" "$BATCH" "$SEQ")
  d=$("$BUILD/bench_gpt2_step" small "$STEPS" "$THREADS" "$BATCH" "$SEQ" dense)
  p=$($PY "$ROOT/bench/gpt2_step_torch.py" small "$STEPS" "$THREADS" "$BATCH" "$SEQ")
  ours=$(best "$(echo "$o" | get tokens_per_s)" "$ours"); dense=$(best "$(echo "$d" | get tokens_per_s)" "$dense")
  py=$(best "$(echo "$p" | get tokens_per_s)" "$py")
  [[ $round == 1 ]] && { rss_o=$(echo "$o" | get peak_rss_mb); rss_d=$(echo "$d" | get peak_rss_mb); rss_p=$(echo "$p" | get peak_rss_mb); }
done
c=$("$BUILD/bench_gpt2_step" small "$STEPS" "$THREADS" "$BATCH" "$SEQ" checkpoint)
printf "%-34s %12s %10s %12s\n" side tokens/s "vs python" "peak RSS MB"
printf "%-34s %12s %10s %12s\n" "python (dense logits)" "$py" "1.000" "$rss_p"
printf "%-34s %12s %10s %12s\n" "polytrain (fused LM loss)" "$ours" "$(awk -v a="$ours" -v b="$py" 'BEGIN{printf "%.3f", a/b}')" "$rss_o"
printf "%-34s %12s %10s %12s\n" "polytrain (dense logits)" "$dense" "$(awk -v a="$dense" -v b="$py" 'BEGIN{printf "%.3f", a/b}')" "$rss_d"
printf "%-34s %12s %10s %12s\n" "polytrain (fused + checkpointing)" "$(echo "$c" | get tokens_per_s)" \
  "$(awk -v a="$(echo "$c" | get tokens_per_s)" -v b="$py" 'BEGIN{printf "%.3f", a/b}')" "$(echo "$c" | get peak_rss_mb)"
