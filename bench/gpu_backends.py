"""Every backend once on the GPU (part of bench/gpu_step.sh; needs build-gpu/ with train_gpt2 and
launch): GPT-2 tiny on the corpus, dropout off, fp32 without TF32, the same seed and data, 30
steps, as

  pytorch on the CPU (the reference the CPU tests use), pytorch on the GPU, pytorchDDP at world 1
  over NCCL (through launch), deepspeed ZeRO-2 with CPU offload and pinned memory, deepspeed+mpu
  (tensor parallelism) at model_parallel_size 1, and amp O0-O3 on GPT-2 124M;

each loss curve against the GPU pytorch run's, with the CPU tests' tolerances. Then the
ZeRO-offload step of GPT-2 124M (bf16, 8 x 1024, pinned) against the same step with the
optimizer on the GPU, the bytes per parameter each way, and pinned host<->device GB/s measured
here (the link's ceiling for those copies).

Usage: gpu_backends.py [BUILD_DIR]   (prints "key value" lines and a summary)
"""
import glob
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from shipped_config import load  # noqa: E402

BUILD = sys.argv[1] if len(sys.argv) > 1 else "build-gpu"
TMP = "/tmp/gpu_backends"
os.makedirs(TMP, exist_ok=True)


def tiny(env, steps=30, extra=None):
    c = load("gpt2_tiny.json")
    c["model"].update({"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0})
    c["train_batch_size"] = c["train_micro_batch_size_per_gpu"] = 8
    c["gradient_accumulation_steps"] = 1
    c["trainer"].update({"env_type": env, "max_steps": steps, "log_interval": 1, "eval_interval": 0,
                         "save_interval": 0, "tf32": False, "seed": 1234})
    c.pop("zero_optimization", None)
    if extra:
        extra(c)
    return c


def big(c):  # GPT-2 124M at 1024 positions
    c["model"].update({"n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12})
    c["data"]["max_seq_length"] = 1024


def run(tag, cfg, device="cuda", launch=False, timeout=120, env=None):
    path = f"{TMP}/{tag}.json"
    with open(path, "w") as f:
        json.dump(cfg, f)
    exp = f"{TMP}/exp_{tag}"
    cmd = [f"{BUILD}/train_gpt2", "--config", path, "--pytorch_device", device, "--no_progress_bar",
           "--experiments_dir", exp, "--experiment_name", tag]
    if launch:
        cmd = [f"{BUILD}/launch", "--num_gpus", "1", "--master_port", "29641"] + cmd
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    wall = time.time() - t0
    files = glob.glob(f"{exp}/**/metrics.jsonl", recursive=True)
    losses, ms = {}, []
    if files:
        for line in open(files[0]):
            r = json.loads(line)
            if "loss" in r and "step" in r:
                losses[r["step"]] = r["loss"]
            if "ms_per_step" in r and r.get("step", 0) > 3:
                ms.append(r["ms_per_step"])
    print(f"run {tag} rc {p.returncode} wall_s {wall:.1f} steps {len(losses)}"
          f" median_ms {sorted(ms)[len(ms) // 2] if ms else '-'}")
    if p.returncode != 0:
        print("\n".join("   " + l for l in (p.stdout + p.stderr).strip().splitlines()[-6:]))
    return losses, (sorted(ms)[len(ms) // 2] if ms else None)


def compare(name, got, ref, rtol):
    steps = sorted(set(got) & set(ref))
    if not steps:
        print(f"check {name}: no common steps (FAIL)")
        return
    worst = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in steps)
    print(f"check {name}: {len(steps)} steps, max rel diff {worst:.2e} (tolerance {rtol:.0e}) "
          f"{'ok' if worst <= rtol else 'FAIL'}; loss {ref[steps[0]]:.4f} -> {ref[steps[-1]]:.4f}")


def pinned_gbps(mb=512):
    n = mb * (1 << 20) // 4
    host = torch.empty(n, dtype=torch.float32).pin_memory()
    dev = torch.empty(n, dtype=torch.float32, device="cuda")
    out = {}
    for name, f in (("h2d", lambda: dev.copy_(host, non_blocking=True)),
                    ("d2h", lambda: host.copy_(dev, non_blocking=True))):
        f(); torch.cuda.synchronize()
        t = []
        for _ in range(5):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); f(); e.record(); e.synchronize()
            t.append(s.elapsed_time(e) / 1e3)
        out[name] = n * 4 / min(t) / 1e9
    return out


ref_gpu, _ = run("pytorch_gpu", tiny("pytorch"))
ref_cpu, _ = run("pytorch_cpu", tiny("pytorch"), device="cpu")
compare("pytorch cuda vs cpu (fp32)", ref_gpu, ref_cpu, 1e-3)
ddp, _ = run("ddp_nccl", tiny("pytorchDDP"), launch=True)
compare("pytorchDDP world 1 (nccl) vs pytorch", ddp, ref_gpu, 1e-5)


def zero_offload(c):
    c["zero_optimization"] = {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5000000,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}}


z, _ = run("zero2_offload", tiny("deepspeed", extra=zero_offload), launch=True)
compare("deepspeed ZeRO-2 offload (pinned) vs pytorch", z, ref_gpu, 1e-3)


def tp1(c):
    c["trainer"]["model_parallel_size"] = 1


tp, _ = run("tp_world1", tiny("deepspeed+mpu", extra=tp1), launch=True)
compare("deepspeed+mpu model_parallel_size 1 vs pytorch", tp, ref_gpu, 1e-5)

# ZeRO-offload speed on GPT-2 124M (bf16 autocast, fp32 parameters): 4 bytes of gradient down and
# 4 bytes of parameter up per parameter and step.
bw = pinned_gbps()
print(f"pinned_h2d_gbps {bw['h2d']:.1f}\npinned_d2h_gbps {bw['d2h']:.1f}")


def big_bf16(c):
    big(c)
    c["bf16"] = {"enabled": True}
    c["model"]["attn_implementation"] = "sdpa"
    c["optimizer"]["params"]["fused"] = True


_, ms_gpu = run("gpt2_124m_gpu_adamw", tiny("pytorch", steps=12, extra=big_bf16), timeout=150)


def big_offload(c):
    big_bf16(c)
    c["optimizer"]["params"].pop("fused", None)
    zero_offload(c)


_, ms_off = run("gpt2_124m_zero2_offload", tiny("deepspeed", steps=12, extra=big_offload), launch=True, timeout=200)
params = 124439808
if ms_gpu and ms_off:
    moved = params * 8 / 1e9
    t_link = params * 4 / (bw["d2h"] * 1e9) + params * 4 / (bw["h2d"] * 1e9)
    print(f"zero_offload ms/step {ms_off:.1f} vs optimizer on the GPU {ms_gpu:.1f} ({ms_off / ms_gpu:.2f}x); "
          f"{moved:.2f} GB over PCIe per step (4 B/param down, 4 B/param up) = {1e3 * t_link:.1f} ms at the "
          f"measured pinned rates ({100 * 1e3 * t_link / ms_off:.0f}% of the offload step)")

# amp O0-O3 on GPT-2 124M at 8 x 1024 (O3: pure fp16, no master weights, as Apex's).
for lvl in ("O0", "O1", "O2", "O3"):
    def amp(c, lvl=lvl):
        big(c)
        c["amp"] = {"enabled": lvl != "O0", "opt_level": lvl}
    losses, ms = run(f"amp_{lvl}", tiny("pytorch", steps=15, extra=amp), timeout=120)
    if losses:
        s = sorted(losses)
        print(f"amp {lvl}: loss {losses[s[0]]:.4f} -> {losses[s[-1]]:.4f} over {len(s)} steps, median {ms} ms/step")
