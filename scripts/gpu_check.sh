#!/usr/bin/env bash
# GPU check (issue 4): on a CUDA machine with a Python PyTorch (whose LibTorch we build against),
# configure and build polytrain, run the NCCL communicator test, the whole ctest suite, and
# train_bert with env_type pytorchDDP at world size 1 on the GPU, through `launch`.
#
#   scripts/gpu_check.sh --prepare   # here (Debian): copy header-only deps + googletest sources to .deps/
#   scripts/gpu_check.sh             # there: build into build-gpu/, logs into $OUT (or /tmp/gpu_out)
#
# The GPU machine has none of our Debian packages and no registry, so nlohmann_json, CLI11 and
# googletest travel in .deps/ (git-ignored), given to CMake as POLYTRAIN_THIRD_PARTY.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ "${1:-}" = --prepare ]; then
  rm -rf .deps && mkdir -p .deps
  cp -r /usr/include/nlohmann /usr/include/CLI .deps/
  cp -r /usr/src/googletest .deps/googletest
  # PCRE2 for GPT-2's BPE tokenizer (train_gpt2): header and library, given to CMake by path.
  mkdir -p .deps/pcre2/include .deps/pcre2/lib
  cp /usr/include/pcre2.h .deps/pcre2/include/
  cp -L /usr/lib/x86_64-linux-gnu/libpcre2-8.so.0 .deps/pcre2/lib/
  echo "prepared .deps ($(du -sh .deps | cut -f1)); carry .deps and .cache/assets"
  exit 0
fi
OUT="${OUT:-/tmp/gpu_out}"
mkdir -p "$OUT"
PY=python3
{
  uname -sr; grep PRETTY_NAME /etc/os-release; g++ --version | head -1; cmake --version | head -1
  nvidia-smi -L; echo "gloo headers: $(find / -path "*gloo/algorithm.h" -not -path "/proc/*" 2>/dev/null | head -3)"
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
} 2>&1 | tee "$OUT/machine.txt"
TORCH_PREFIX="$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')"
NCCL_INC="$($PY -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))' 2>/dev/null)"
NCCL_LIB="$($PY -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)"
GEN=""
command -v ninja >/dev/null && GEN="-G Ninja"
step() { echo "== $* ($(date +%T))"; }
step configure
t0=$(date +%s)
cmake -S . -B build-gpu $GEN -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
  -DPOLYTRAIN_THIRD_PARTY="$ROOT/.deps" ${NCCL_INC:+-DNCCL_INCLUDE_DIR="$NCCL_INC"} \
  ${GPU_CMAKE_ARGS:-} > "$OUT/configure.log" 2>&1 || { tail -40 "$OUT/configure.log"; exit 1; }
grep -E "polytrain communicators|CUDA|Torch" "$OUT/configure.log" | head -8
step build
cmake --build build-gpu -j "$(nproc)" ${GPU_TARGETS:+--target $GPU_TARGETS} -- -k 0 > "$OUT/build.log" 2>&1
brc=$?
echo "build rc=$brc in $(( $(date +%s) - t0 )) s"
if [ $brc -ne 0 ]; then grep -E "error|FAILED" "$OUT/build.log" | head -60; fi
export LD_LIBRARY_PATH="${NCCL_LIB:+$NCCL_LIB:}${LD_LIBRARY_PATH:-}"
if [ -x build-gpu/test_comm ]; then
  step test_comm
  build-gpu/test_comm 2>&1 | tail -25 | tee "$OUT/test_comm.log"
fi
if [ -x build-gpu/train_bert ] && [ -x build-gpu/launch ]; then
  step "train_bert pytorchDDP world 1 on cuda through launch"
  build-gpu/launch --num_gpus 1 build-gpu/train_bert --config configs/bert_tiny_ddp.json --pytorch_device cuda \
    --max_steps "${GPU_STEPS:-300}" --no_progress_bar --experiments_dir /tmp/exp 2>&1 | tee "$OUT/train_gpu.log" | tail -25
  echo "train rc=${PIPESTATUS[0]}"
fi
if [ -x build-gpu/train_bert ]; then
  # fp16 (dynamic loss scale) and bf16 against fp32: the same run (seed, data, dropout off)
  # three times; the logged loss curves and final eval losses side by side.
  step "precision: fp32 vs fp16 vs bf16 (train_bert, ${PREC_STEPS:-300} steps on cuda)"
  for p in fp32 fp16 bf16; do
    python3 - "$p" > "/tmp/bert_$p.json" <<'PY'
import json, sys
sys.path.insert(0, "scripts"); from shipped_config import load; c = load("bert_tiny.json")
c["model"]["hidden_dropout_prob"] = c["model"]["attention_probs_dropout_prob"] = 0.0
if sys.argv[1] != "fp32":
    c[sys.argv[1]] = {"enabled": True}
print(json.dumps(c))
PY
    build-gpu/train_bert --config "/tmp/bert_$p.json" --pytorch_device cuda --max_steps "${PREC_STEPS:-300}" \
      --log_interval 10 --save_interval 0 --no_progress_bar --experiments_dir "/tmp/prec_$p" --experiment_name "$p" \
      > "$OUT/train_$p.log" 2>&1 || { echo "$p run failed:"; tail -5 "$OUT/train_$p.log"; }
    grep -E "overflow" "$OUT/train_$p.log" | head -5
  done
  python3 - <<'PY'
import glob, json
def curve(p):
    f = glob.glob(f"/tmp/prec_{p}/*/{p}/metrics.jsonl")
    if not f: return None, None
    recs = [json.loads(l) for l in open(f[0])]
    train = {r["step"]: r["loss"] for r in recs if "loss" in r}
    ev = [r["eval_loss"] for r in recs if "eval_loss" in r]
    return train, ev[-1] if ev else None
base, base_eval = curve("fp32")
for p in ("fp16", "bf16"):
    c, e = curve(p)
    if not c or not base:
        print(p, "no metrics"); continue
    steps = sorted(set(c) & set(base))
    rel = [abs(c[s] / base[s] - 1) for s in steps]
    print(f"{p}: {len(steps)} logged steps, loss vs fp32: mean |rel diff| {sum(rel)/len(rel):.4f}, max {max(rel):.4f}; "
          f"final loss {c[steps[-1]]:.4f} vs {base[steps[-1]]:.4f}; final eval loss {e:.4f} vs fp32 {base_eval:.4f}")
PY
fi
if [ -z "${GPU_SKIP_CTEST:-}" ] && [ -d build-gpu ]; then
  step "ctest"
  (cd build-gpu && ctest -j 8 --timeout 300 --output-on-failure > "$OUT/ctest.log" 2>&1; echo "ctest rc=$?")
  grep -E "tests passed|Failed|\*\*\*|Not Run|Skipped" "$OUT/ctest.log" | head -40
fi
if [ -x build-gpu/test_atomic_file ]; then
  step "link order (libstdc++ must come before libtorch: pytorch/pytorch#133437)"
  readelf -d build-gpu/test_atomic_file | grep NEEDED | head -4
  echo "std::filesystem symbols libtorch_cpu exports: $(nm -D --defined-only "$TORCH_PREFIX/../../lib/libtorch_cpu.so" 2>/dev/null | grep -c ' _ZN*St10filesystem')"
  if ! build-gpu/test_atomic_file > /dev/null 2>&1 && command -v cuda-gdb >/dev/null; then
    cuda-gdb -batch -ex run -ex bt --args build-gpu/test_atomic_file --gtest_filter='AtomicFileTest.WritesAndReplacesContent' 2>&1 | tail -15
  fi
fi

