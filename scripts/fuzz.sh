#!/usr/bin/env bash
# libFuzzer targets for the parsers of outside input (fuzz/fuzz_*.cpp), built with Debian's
# clang (-fsanitize=fuzzer,address,undefined) into build-fuzz/ and run SECONDS each.
# Usage: scripts/fuzz.sh [SECONDS] [TARGET...]       (default 60 s, every target)
# Prints per target: executions, executions/s, corpus entries, and any crash with the input
# that caused it (build-fuzz/crashes/TARGET/). Exit code 1 when a target crashed.
# Seeds: fuzz/seeds/TARGET/ (committed) plus the project's real files (configs, hostfiles of
# the tests, .cache/assets), copied into build-fuzz/corpus/TARGET/, which grows run to run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SECONDS_EACH="${1:-60}"
shift || true
OUT="$ROOT/build-fuzz"
CXX="${FUZZ_CXX:-$(command -v clang++-14 || command -v clang++ || true)}"
if [ -z "$CXX" ]; then
  echo "fuzz: installing clang (the fuzzing compiler)"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends clang-14 libclang-rt-14-dev >/dev/null
  CXX=clang++-14
fi
# The tokenizer targets also run the real BERT vocab and GPT-2 files: fetched when missing.
if [ ! -f "$ROOT/.cache/assets/vocab/bert-base-uncased-vocab.txt" ] || [ ! -f "$ROOT/.cache/assets/gpt2/encoder.json" ]; then
  bash "$ROOT/scripts/fetch_assets.sh" >&2
fi
mkdir -p "$OUT/include" "$OUT/bin" "$OUT/corpus" "$OUT/crashes" "$OUT/logs"
ln -sfn "$ROOT/src" "$OUT/include/polytrain"

# target -> its sources and libraries (torch: the Debian libtorch the project builds against)
# The config names its optimizers through the optimizer registry, whose entries build them (torch),
# and checks model_parallel_size with the parallel dims' rules.
CONFIG_SRC="src/common/config.cpp src/common/config_keys.cpp src/common/config_flagai.cpp src/common/config_paths.cpp \
  src/optim/optimizer_registry.cpp src/optim/optimizers.cpp src/optim/cpu_adam.cpp src/optim/lamb.cpp src/optim/multi_tensor_adam.cpp \
  src/optim/worker_pool.cpp src/optim/optimizers_8bit.cpp src/optim/cpu_optim_8bit.cpp src/optim/blockwise_quant.cpp \
  src/parallel/parallel_dims.cpp"
declare -A SOURCES=(
  [fuzz_config]="$CONFIG_SRC"
  [fuzz_hostfile]="src/launcher/hostfile.cpp"
  [fuzz_env_file]="src/launcher/env_file.cpp src/launcher/hostfile.cpp"
  [fuzz_hf_config]="$CONFIG_SRC src/models/hf_config.cpp src/models/bert_config.cpp src/models/albert_config.cpp src/models/gpt2_config.cpp src/models/t5_config.cpp"
  [fuzz_safetensors]="src/checkpoint/safetensors.cpp src/common/atomic_file.cpp"
  [fuzz_checkpoint]="$CONFIG_SRC src/checkpoint/checkpoint.cpp src/checkpoint/checkpoint_marker.cpp src/checkpoint/archive_codec.cpp src/checkpoint/safetensors.cpp src/common/atomic_file.cpp src/common/crc32c.cpp src/common/fault.cpp"
  [fuzz_wordpiece]="src/data/wordpiece.cpp src/data/tokenizer_file.cpp src/data/utf8.cpp src/data/unicode_tables.cpp"
  [fuzz_gpt2_bpe]="src/data/gpt2_bpe.cpp src/data/tokenizer_file.cpp src/data/utf8.cpp src/data/unicode_tables.cpp"
)
TORCH="-isystem /usr/include/torch/csrc/api/include -ltorch -ltorch_cpu -lc10"
declare -A LIBS=([fuzz_gpt2_bpe]="-lpcre2-8" [fuzz_safetensors]="$TORCH" [fuzz_checkpoint]="$TORCH" [fuzz_config]="$TORCH"
                 [fuzz_hf_config]="$TORCH")
ALL=(fuzz_config fuzz_hostfile fuzz_env_file fuzz_hf_config fuzz_safetensors fuzz_checkpoint fuzz_wordpiece fuzz_gpt2_bpe)
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=("${ALL[@]}")

FLAGS=(-std=gnu++17 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
       -I"$OUT/include" -DPOLYTRAIN_SOURCE_DIR="\"$ROOT\"" -DPOLYTRAIN_WITH_PCRE2=1)

build() {  # TARGET: rebuilt when its sources or any header under src/ changed
  local t=$1 bin="$OUT/bin/$1"
  local srcs=("$ROOT/fuzz/$t.cpp")
  for s in ${SOURCES[$t]}; do srcs+=("$ROOT/$s"); done
  if [ -x "$bin" ] && [ -z "$(find "${srcs[@]}" "$ROOT/fuzz/fuzz_util.h" "$ROOT/src" -name '*.*' -newer "$bin" -print -quit)" ]; then
    return 0
  fi
  echo "fuzz: building $t"
  "$CXX" "${FLAGS[@]}" "${srcs[@]}" ${LIBS[$t]:-} -o "$bin"
}

seed() {  # TARGET: the corpus folder, seeded once from fuzz/seeds and the project's files
  local t=$1 dir="$OUT/corpus/$1"
  mkdir -p "$dir"
  [ -d "$ROOT/fuzz/seeds/$t" ] && cp -n "$ROOT/fuzz/seeds/$t"/* "$dir/" 2>/dev/null || true
  case $t in
    fuzz_config)  # every shipped config (FuzzedDataProvider takes the world size from the tail)
      for f in "$ROOT"/configs/*.json; do cp -n "$f" "$dir/"; done ;;
    fuzz_wordpiece)  # a vocab slice, then text (FuzzedDataProvider reads a length-prefixed head)
      [ -f "$ROOT/.cache/assets/vocab/bert-base-uncased-vocab.txt" ] &&
        head -c 3000 "$ROOT/.cache/assets/vocab/bert-base-uncased-vocab.txt" >"$dir/vocab_head" || true
      [ -f "$ROOT/.cache/assets/corpus/sherlock.txt" ] && head -c 2000 "$ROOT/.cache/assets/corpus/sherlock.txt" >"$dir/sherlock_head" || true ;;
    fuzz_gpt2_bpe)
      [ -f "$ROOT/.cache/assets/gpt2/vocab.bpe" ] && head -c 3000 "$ROOT/.cache/assets/gpt2/vocab.bpe" >"$dir/merges_head" || true
      [ -f "$ROOT/.cache/assets/corpus/mobydick.txt" ] && head -c 2000 "$ROOT/.cache/assets/corpus/mobydick.txt" >"$dir/mobydick_head" || true ;;
  esac
}

status=0
printf '%-17s %12s %10s %8s  %s\n' target executions exec/s corpus result
for t in "${TARGETS[@]}"; do
  [ -n "${SOURCES[$t]:-}" ] || { echo "error: unknown fuzz target '$t' (known: ${ALL[*]})" >&2; exit 2; }
  build "$t" >&2
  seed "$t"
  mkdir -p "$OUT/crashes/$t"
  log="$OUT/logs/$t.log"
  set +e
  "$OUT/bin/$t" "$OUT/corpus/$t" -max_total_time="$SECONDS_EACH" -rss_limit_mb=2048 -malloc_limit_mb=512 \
    -max_len=65536 -timeout=10 -print_final_stats=1 -artifact_prefix="$OUT/crashes/$t/" >"$log" 2>&1
  rc=$?
  set -e
  execs=$(awk '/stat::number_of_executed_units/{print $NF}' "$log")
  rate=$(awk '/stat::average_exec_per_sec/{print $NF}' "$log")
  corpus=$(ls "$OUT/corpus/$t" | wc -l)
  if [ $rc -eq 0 ]; then
    result="no crash"
  else
    status=1
    art=$(grep -o 'Test unit written to [^ ]*' "$log" | tail -1 | sed 's/Test unit written to //')
    result="CRASH (exit $rc): $(grep -m1 -E 'ERROR:|runtime error|uncaught|deadly' "$log" | cut -c1-120) input: ${art:-see $log}"
  fi
  printf '%-17s %12s %10s %8s  %s\n' "$t" "${execs:-?}" "${rate:-?}" "$corpus" "$result"
done
exit $status
