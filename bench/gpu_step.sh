#!/usr/bin/env bash
# GPU step speed (issue 15), one script, one run, on a CUDA machine with a Python PyTorch:
# GPT-2 124M (seq 1024), BERT-base (seq 512) and T5-small (512 -> 128) training steps in
# bf16, polytrain (bench_gpu_step) side by side with Python PyTorch eager and torch.compile
# (bench/gpu_step_torch.py: the experts' settings), at the largest micro-batch of BATCHES that
# fits each side; tokens/s, MFU, peak GPU memory, host syncs; the bf16 GEMM ceiling measured
# in the same run; then the fast path's switches one at a time (where the time goes), and the
# equal-results check: train_gpt2 on the corpus, 200 steps, fast path against the exact path.
#
#   bench/gpu_step.sh --prepare   # here (Debian): header-only deps, googletest, pcre2 to .deps/
#   bench/gpu_step.sh             # there: logs and results.txt into $OUT (or /tmp/gpu_step_out)
#
# MFU = model FLOPs per step / step time / 989.4 TFLOP/s (H100 SXM dense bf16; the H200's is
# the same). Model FLOPs: 6 x (matmul parameters x tokens they apply to) + 12 x layers x width
# x Lq x Lk per sample for attention (causal attention counted in full, as PaLM's formula does).
# GPT-2: matmul parameters = the blocks' 12 d^2 per layer + the tied head d V (position
# embeddings, biases and LayerNorms left out). BERT: the head only at the 15% of labelled
# positions (the work the loss needs; HF computes it at every position). T5: encoder layers on
# encoder tokens, decoder layers and head on decoder tokens, self and cross attention.
# Order: the build (niced, with the GPU tests) beside the torch.compile runs, then the GPU
# tests, the headline pairs (polytrain next to Python eager), GPT-2 without polytrain's CUDA
# kernels, polytrain's kernel profiles (GPT-2, T5), the 200-step curves, every backend on the
# GPU (bench/gpu_backends.py) and Python's eager profile; items that would pass DEADLINE seconds
# are skipped and the summary still prints.
# env: STEPS (10), GPT2_BATCHES (64,48,32,16), BERT_BATCHES (128,96,64,32), T5_BATCHES
# (256,128,64), CURVE_STEPS (200), PROFILE_BATCH (32), DEADLINE (540), SKIP_PY_COMPILE=1,
# SKIP_BUILD=1 (reuse build-gpu/ on a machine still warm from the last call).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ "${1:-}" = --prepare ]; then exec bash scripts/gpu_check.sh --prepare; fi
OUT="${OUT:-/tmp/gpu_step_out}"
mkdir -p "$OUT"
RES="$OUT/results.txt"
LOG="$OUT/log.txt"
: > "$RES"
: > "$LOG"
PY="${PY:-python3}"
STEPS="${STEPS:-10}"
GB="${GPT2_BATCHES:-64,48,32,16}" BB="${BERT_BATCHES:-128,96,64,32}" TB="${T5_BATCHES:-256,128,64}"
export PYTHONUNBUFFERED=1
# polytrain's CUDA kernels (src/ops) are off by default until they have run on a GPU: on here
# for every polytrain run, off for the "nokernels" comparison.
export POLYTRAIN_FUSED_KERNELS="${POLYTRAIN_FUSED_KERNELS:-1}"
{
  echo "== machine"
  uname -sr; grep PRETTY_NAME /etc/os-release; g++ --version | head -1; nproc
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
  $PY -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'
} >> "$RES" 2>&1
TORCH_PREFIX="$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')"
EXTRA=()  # extra CMake arguments: PCRE2 and NCCL from where this machine has them
if [ -f .deps/pcre2/include/pcre2.h ]; then
  EXTRA=(-DPCRE2_INCLUDE="$ROOT/.deps/pcre2/include" -DPCRE2_LIBRARY="$ROOT/.deps/pcre2/lib/libpcre2-8.so.0")
fi
GEN=""
command -v ninja >/dev/null && GEN="-G Ninja"
# NCCL's header from the Python wheel (nvidia-nccl-*), as scripts/gpu_check.sh finds it.
NCCL_INC="$($PY -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))' 2>/dev/null)"
NCCL_LIB="$($PY -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)"
export LD_LIBRARY_PATH="${NCCL_LIB:+$NCCL_LIB:}${LD_LIBRARY_PATH:-}"
[ -n "$NCCL_INC" ] && EXTRA+=(-DNCCL_INCLUDE_DIR="$NCCL_INC")
# polytrain's CUDA kernels need nvcc: PATH's, else the toolkit's usual place.
CUDACXX_ARG=()
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then CUDACXX_ARG=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc); fi
# The tests that need a GPU (they skip everywhere else): the kernels' equal-results tests, the
# fused LM loss, NCCL collectives, autocast and the fp16 loss scale on CUDA.
GPU_TESTS="test_cuda_ops test_fused_lm_loss test_comm test_loss_scaler test_trainer"
# The build runs niced beside the Python runs (those are timed on the GPU; the build only
# takes CPU time they do not need), and the headline pairs are run again after it.
t_build=$(date +%s)
if [ "${SKIP_BUILD:-0}" = 1 ] && [ -x build-gpu/bench_gpu_step ]; then  # a warm machine's second call
  true &
else (
  nice -n 19 cmake -S . -B build-gpu $GEN -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
    -DPOLYTRAIN_THIRD_PARTY="$ROOT/.deps" -DPOLYTRAIN_BUILD_TESTS=ON "${EXTRA[@]}" "${CUDACXX_ARG[@]}" &&
    nice -n 19 cmake --build build-gpu -j "$(nproc)" --target bench_gpu_step bench_gpu_profile train_gpt2 launch \
      $GPU_TESTS -- -k 0
) > "$OUT/build.log" 2>&1 &
fi
BUILD_PID=$!

T0=$(date +%s)
DEADLINE="${DEADLINE:-540}"  # seconds: later items are skipped (the summary always runs)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
run() {  # tag, limit, command...: skipped when the deadline is near, limited to what is left
  local tag=$1 limit=$2
  shift 2
  local l; l=$(left)
  if [ "$l" -lt 20 ]; then echo "== $tag" >> "$RES"; echo "skipped (deadline)" >> "$RES"; return; fi
  [ "$limit" -gt "$l" ] && limit=$l
  echo "== $tag" >> "$RES"
  local t0=$(date +%s)
  timeout "$limit" "$@" >> "$RES" 2>> "$LOG"
  echo "rc $? wall_s $(( $(date +%s) - t0 ))" >> "$RES"
}
py() { run "python $1 $2" 240 $PY bench/gpu_step_torch.py "$@"; }
cpp() { run "polytrain $1 $2" 90 build-gpu/bench_gpu_step "$@"; }
build_failed() {  # the build ended and failed: stop early, keep the device time for a rerun
  if ! kill -0 $BUILD_PID 2>/dev/null; then wait $BUILD_PID; [ $? -ne 0 ]; else return 1; fi
}
build_report() {
  echo "== build after $(( $(date +%s) - t_build )) s" >> "$RES"
  grep -E "error:|FAILED|Error" "$OUT/build.log" | head -60 >> "$RES"
}

run "gemm" 60 $PY bench/gpu_step_torch.py gemm
for item in "gpt2 compile $GB 1024" "bert compile $BB 512" "t5 compile $TB 512"; do
  if build_failed && [ ! -x build-gpu/bench_gpu_step ]; then break; fi
  set -- $item
  [ "${SKIP_PY_COMPILE:-0}" = 1 ] && continue
  if [ "$1" = t5 ]; then py $1 $2 $3 $4 "$STEPS" 128; else py $1 $2 $3 $4 "$STEPS"; fi
done
wait $BUILD_PID
brc=$?
build_report
if [ ! -x build-gpu/bench_gpu_step ]; then  # bench_gpu_profile may fail alone: it is extra
  echo "build failed (rc $brc): see build.log"
  tail -60 "$RES"
  exit 1
fi
grep -E "CUDA kernels|communicators" "$OUT/build.log" >> "$RES"
# The GPU tests (kernels against the unfused ops, NCCL, CUDA autocast, fp16 loss scale).
for t in $GPU_TESTS; do
  [ -x "build-gpu/$t" ] || { echo "== test $t"; echo "not built"; } >> "$RES"
  [ -x "build-gpu/$t" ] || continue
  filter='*'
  [ "$t" = test_comm ] && filter='Nccl*'
  [ "$t" = test_trainer ] && filter='*Cuda*'
  run "test $t" 60 "build-gpu/$t" --gtest_filter="$filter" --gtest_brief=1
done
# The headline pairs, each polytrain run next to Python eager's, with the build done.
cpp gpt2 fast "$GB" 1024 "$STEPS"
py gpt2 eager "$GB" 1024 "$STEPS"
cpp bert fast "$BB" 512 "$STEPS"
py bert eager "$BB" 512 "$STEPS"
cpp t5 fast "$TB" 512 "$STEPS" 128
py t5 eager "$TB" 512 "$STEPS" 128
# The fast path without polytrain's CUDA kernels (the padded vocabulary stays): what they bring.
run "polytrain gpt2 fast,nokernels" 90 env POLYTRAIN_FUSED_KERNELS=0 build-gpu/bench_gpu_step gpt2 fast "$GB" 1024 "$STEPS"
# Where the time goes: kernels by kind, GPU idle time (polytrain's; Python's after the rest).
PB="${PROFILE_BATCH:-32}"
[ -x build-gpu/bench_gpu_profile ] && run "profile polytrain gpt2 fast" 90 build-gpu/bench_gpu_profile gpt2 fast "$PB" 1024 3
[ -x build-gpu/bench_gpu_profile ] && run "profile polytrain t5 fast" 90 build-gpu/bench_gpu_profile t5 fast 128 512 3 128
# Equal results (issue 15's "must show"): the fast path against the exact path on the
# corpus with train_gpt2, dropout off, the same seed and data, 200 steps.
if [ -x build-gpu/train_gpt2 ]; then
  for v in fast exact; do
    $PY - "$v" "${CURVE_STEPS:-200}" > "/tmp/curve_$v.json" <<'PY'
import json, sys
v, steps = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, "scripts"); from shipped_config import load; c = load("gpt2_tiny.json")
c["train_batch_size"] = c["train_micro_batch_size_per_gpu"] = 8
c["model"].update({"n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
                   "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                   "attn_implementation": "eager" if v == "exact" else "sdpa"})
c["data"]["max_seq_length"] = 1024
c["optimizer"]["params"].update({"lr": 6e-4, "fused": v != "exact"})
c["scheduler"]["params"].update({"warmup_max_lr": 6e-4, "warmup_num_steps": 20, "total_num_steps": steps})
c["trainer"].update({"max_steps": steps, "log_interval": 1, "eval_interval": steps, "save_interval": 0,
                     "tf32": v != "exact"})
if v == "fast":
    c["bf16"] = {"enabled": True}
print(json.dumps(c))
PY
    run "curve $v" 150 build-gpu/train_gpt2 --config "/tmp/curve_$v.json" --pytorch_device cuda --no_progress_bar \
      --experiments_dir "/tmp/curves" --experiment_name "$v"
    tail -3 "$LOG" >> "$RES"
  done
fi
# Every backend once on the GPU (pytorch on the CPU and the GPU, pytorchDDP over NCCL, ZeRO-2
# offload with pinned memory, tensor parallelism at size 1, amp O0-O3) and the ZeRO-offload step
# with the pinned PCIe rates: bench/gpu_backends.py.
[ -x build-gpu/train_gpt2 ] && [ -x build-gpu/launch ] && run "backends" 300 $PY bench/gpu_backends.py build-gpu
run "profile python gpt2 eager" 120 $PY bench/gpu_step_torch.py gpt2 eager-profile "$PB" 1024 3
[ "${PROFILE_COMPILE:-0}" = 1 ] && run "profile python gpt2 compile" 120 $PY bench/gpu_step_torch.py gpt2 compile-profile "$PB" 1024 3
$PY - "$RES" <<'PY' | tee "$OUT/summary.txt"
import glob, json, re, sys
blocks, cur = {}, None
for line in open(sys.argv[1]):
    line = line.rstrip("\n")
    if line.startswith("== "):
        cur = line[3:]; blocks[cur] = {}
    elif cur is not None and " " in line:
        k, v = line.split(" ", 1); blocks[cur].setdefault(k, v)
print("\n".join(l for l in open(sys.argv[1]).read().split("\n")[:8]))
gemm = blocks.get("gemm", {}).get("gemm_bf16_tflops")
print(f"bf16 GEMM 8192^3 measured: {gemm} TFLOP/s (datasheet dense peak 989.4)")
PEAK = 989.4e12
def row(tag, ref_flops):
    b = blocks.get(tag)
    if not b or "tokens_per_s" not in b:
        print(f"{tag:46s} (no result: rc {b.get('rc') if b else '-'})"); return None
    tps = float(b["tokens_per_s"]); ms = float(b["ms_per_step"]); batch = int(b["batch"])
    f = ref_flops(batch) if ref_flops else None
    mfu = f"{100 * f / (ms / 1e3) / PEAK:5.1f}%" if f else "   - "
    print(f"{tag:46s} batch {batch:4d} {ms:9.2f} ms {tps:10.0f} tok/s  MFU {mfu}  peak {b.get('peak_mem_gb', '-'):>6s} GB"
          f"  syncs/step {b.get('syncs_per_step', '-')}")
    return tps
for model, fast in (("gpt2", "fast"), ("bert", "fast"), ("t5", "fast")):
    ours = blocks.get(f"polytrain {model} {fast}", {})
    per_tok = None
    if "model_flops_per_step" in ours:
        fl, bt = float(ours["model_flops_per_step"]), int(ours["batch"])
        per_sample = fl / bt
        per_tok = lambda b, s=per_sample: s * b
    print(f"-- {model}")
    t_ours = row(f"polytrain {model} {fast}", per_tok)
    t_eager = row(f"python {model} eager", per_tok)
    t_comp = row(f"python {model} compile", per_tok)
    if t_ours and t_eager: print(f"   polytrain / python eager: {t_ours / t_eager:.3f}")
    if t_ours and t_comp: print(f"   polytrain / torch.compile: {t_ours / t_comp:.3f}")
print("-- gpt2 switches (polytrain)")
for tag in [t for t in blocks if t.startswith("polytrain gpt2 ") and t != "polytrain gpt2 fast"]:
    b = blocks[tag]
    if "ms_per_step" in b:
        print(f"{tag:46s} batch {b['batch']:>4s} {float(b['ms_per_step']):9.2f} ms {b['tokens_per_s']:>8s} tok/s  fwd {b.get('forward_ms')} bwd {b.get('backward_ms')} update {b.get('update_ms')}  peak {b.get('peak_mem_gb')} GB")
for tag in ("profile polytrain gpt2 fast", "profile python gpt2 eager", "profile polytrain t5 fast", "profile python gpt2 compile"):
    if tag in blocks:
        print(f"-- {tag}")
        inside = False
        for line in open(sys.argv[1]):
            if line.startswith("== "): inside = line[3:].strip() == tag; continue
            if inside and line.split(" ")[0] in ("batch", "wall_ms_per_step", "gpu_busy_ms_per_step", "gpu_idle_ms_per_step", "kind", "kernel"):
                print("   " + line.rstrip())
def lines_of(tag):
    inside, out = False, []
    for line in open(sys.argv[1]):
        if line.startswith("== "): inside = line[3:].strip() == tag; continue
        if inside: out.append(line.rstrip())
    return out
print("-- GPU tests")
for tag in [t for t in blocks if t.startswith("test ")]:
    body = lines_of(tag)
    rc = [l for l in body if l.startswith("rc ")]
    failed = [l for l in body if "FAILED" in l or "not built" in l]
    print(f"   {tag:28s} {rc[-1] if rc else 'no result'}" + ("" if not failed else "  " + "; ".join(failed[:4])))
print("-- backends on the GPU (bench/gpu_backends.py)")
for l in lines_of("backends"):
    if l.split(" ")[0] in ("check", "zero_offload", "amp", "pinned_h2d_gbps", "pinned_d2h_gbps") or l.startswith("run "):
        print("   " + l)
f = blocks.get("polytrain gpt2 fast", {})
if f: print(f"fast path phases: forward {f.get('forward_ms')} ms, backward {f.get('backward_ms')} ms, update {f.get('update_ms')} ms")
b = blocks.get("polytrain bert bf16,sdpa,tf32,fused,dense")
if b and "tokens_per_s" in b: print(f"bert with the head at every position (HF's work): {b['tokens_per_s']} tok/s")
# Curves
def curve(v):
    fs = glob.glob(f"/tmp/curves/*/{v}/metrics.jsonl") + glob.glob(f"/tmp/curves/{v}/*/metrics.jsonl") + glob.glob(f"/tmp/curves/**/{v}/**/metrics.jsonl", recursive=True)
    if not fs: return None, None, None
    tr, ev, ms = {}, None, []
    for l in open(fs[0]):
        r = json.loads(l)
        if "loss" in r: tr[r["step"]] = r["loss"]
        if "ms_per_step" in r and r["step"] > 5: ms.append(r["ms_per_step"])
        if "eval_loss" in r: ev = r["eval_loss"]
    return tr, ev, ms
ex, ex_ev, ex_ms = curve("exact")
for v in ("fp32fast", "fast"):
    c, ev, ms = curve(v)
    if not c or not ex:
        print(f"curve {v}: missing"); continue
    common = sorted(set(c) & set(ex))
    common = [s for s in common if c[s] is not None and ex[s] is not None]
    if not common:
        print(f"curve {v}: no finite losses"); continue
    d = [abs(c[s] - ex[s]) for s in common]
    rel = [abs(c[s] - ex[s]) / ex[s] for s in common]
    late = [abs(c[s] - ex[s]) for s in common if s > common[-1] - 50]
    print(f"curve {v} vs exact over {len(common)} steps: loss {ex[common[0]]:.4f}->{ex[common[-1]]:.4f} (exact) vs "
          f"{c[common[0]]:.4f}->{c[common[-1]]:.4f}; max |diff| {max(d):.4f} (max rel {100*max(rel):.2f}%), "
          f"mean |diff| last 50 {sum(late)/len(late):.4f}; eval {ex_ev} vs {ev}; "
          f"ms/step {sorted(ex_ms)[len(ex_ms)//2] if ex_ms else '-'} vs {sorted(ms)[len(ms)//2] if ms else '-'}")
PY
