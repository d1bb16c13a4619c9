"""Python side of bench/gpu_step.sh: the training step of bench_gpu_step.cpp in PyTorch, as
its experts run it on a GPU: bf16 autocast, scaled_dot_product_attention, TF32 on, AdamW
(fused=True), clip_grad_norm_(1.0), zero_grad(set_to_none=True), eager or torch.compile.

GPT-2 124M is nanoGPT's formulation of HF's GPT-2 (the same math: gelu tanh, pre-LayerNorm,
tied head, F.scaled_dot_product_attention(is_causal=True)); BERT-base and T5-small are
transformers' BertForMaskedLM (attn_implementation="sdpa") and T5ForConditionalGeneration.
Random tokens, dropout off, the same data shapes as the C++ side.

Usage: gpu_step_torch.py MODEL eager|compile[-profile] BATCHES SEQ STEPS [DEC_SEQ]
       gpu_step_torch.py gemm      (bf16 8192^3 matmul TFLOP/s: the measured ceiling)
Prints "key value" lines (batch, ms_per_step, tokens_per_s, peak_mem_gb, loss). With
-profile: STEPS steps under torch.profiler, printed as bench_gpu_profile prints polytrain's
(wall, GPU busy and idle per step, busy time by kind of kernel, the 12 longest kernels).
"""
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def gemm_tflops():
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1000)
    times.sort()
    return 2 * n ** 3 / times[len(times) // 2] / 1e12


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, vocab=50257, positions=1024, d=768, layers=12, heads=12):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(positions, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.size(1), device=ids.device))
        for blk in self.h:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def build(kind, tiny, seq, dec_seq, dev):
    """(model, make_inputs(batch) -> kwargs, loss_of(model, inputs))"""
    if kind == "gpt2":
        m = GPT2(1000, seq, 64, 2, 2) if tiny else GPT2(positions=max(1024, seq))
        vocab = 1000 if tiny else 50257
        return m, lambda b: {"ids": torch.randint(0, vocab, (b, seq), device=dev)}, lambda mm, x: mm(x["ids"])
    import transformers
    if kind == "bert":
        cfg = transformers.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                      max_position_embeddings=max(512, seq))
        if tiny:
            cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.intermediate_size = 64, 2, 2, 256
        try:
            m = transformers.BertForMaskedLM._from_config(cfg, attn_implementation="sdpa")
        except (TypeError, ValueError):
            cfg._attn_implementation = "sdpa"
            m = transformers.BertForMaskedLM(cfg)

        def inputs(b):
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(1000, cfg.vocab_size, (b, seq), generator=g)
            labels = torch.where(torch.rand(b, seq, generator=g) < 0.15, ids, torch.full_like(ids, -100))
            return {"input_ids": ids.to(dev), "labels": labels.to(dev), "token_type_ids": torch.zeros_like(ids).to(dev)}
        return m, inputs, lambda mm, x: mm(**x).loss
    if kind == "t5":
        cfg = transformers.T5Config(dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
        if tiny:
            cfg.d_model, cfg.d_kv, cfg.d_ff, cfg.num_layers, cfg.num_decoder_layers, cfg.num_heads, cfg.vocab_size = \
                64, 32, 128, 2, 2, 2, 1000
        m = transformers.T5ForConditionalGeneration(cfg)

        def inputs(b):
            g = torch.Generator().manual_seed(1)
            return {"input_ids": torch.randint(2, cfg.vocab_size, (b, seq), generator=g).to(dev),
                    "labels": torch.randint(2, cfg.vocab_size, (b, dec_seq), generator=g).to(dev)}
        return m, inputs, lambda mm, x: mm(**x).loss
    raise SystemExit(f"unknown model {kind}")


def kind_of(name):
    n = name.lower()
    has = lambda *ks: any(k in n for k in ks)
    if has("memcpy", "memset"): return "copies"
    if has("flash", "fmha", "attention"): return "attention"
    if has("multi_tensor_apply", "adam"): return "optimizer (multi-tensor)"
    if has("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "sm90_"): return "matmul"
    if has("layer_norm", "layernorm"): return "layernorm"
    if has("softmax", "xent", "nll", "cross_entropy", "scatter", "gather"): return "softmax / CE"
    if has("reduce"): return "reductions"
    if has("elementwise", "vectorized", "unrolled"): return "elementwise"
    return "other"


def profile(step, x, steps):
    from torch.profiler import ProfilerActivity, profile as tprofile
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step(x)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1000
    spans, kinds, kernels = [], {}, {}
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == torch.autograd.DeviceType.CPU:
            continue
        s, d = e.start_ns(), e.duration_ns()
        spans.append((s, s + d))
        kinds[kind_of(e.name())] = kinds.get(kind_of(e.name()), 0) + d / 1e6
        kernels[e.name()] = kernels.get(e.name(), 0) + d / 1e6
    spans.sort()
    busy, cs, ce = 0, 0, 0
    for s, e in spans:
        if s > ce:
            busy += (ce - cs) / 1e6
            cs, ce = s, e
        else:
            ce = max(ce, e)
    busy += (ce - cs) / 1e6
    print(f"steps {steps}\nwall_ms_per_step {wall / steps:.2f}\ngpu_busy_ms_per_step {busy / steps:.2f}\n"
          f"gpu_idle_ms_per_step {(wall - busy) / steps:.2f}")
    for k, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"kind {k:26s} {ms / steps:9.2f} ms/step")
    for k, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:12]:
        print(f"kernel {ms / steps:9.2f} ms/step  {k[:110]}")


def main():
    if sys.argv[1] == "gemm":
        print(f"gemm_bf16_tflops {gemm_tflops():.1f}")
        return
    name, mode, batches, seq, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    dec_seq = int(sys.argv[6]) if len(sys.argv) > 6 else max(1, seq // 4)
    tiny = name.endswith("-tiny")
    kind = name[:-5] if tiny else name
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    model, make_inputs, loss_of = build(kind, tiny, seq, dec_seq, dev)
    model.to(dev).train()
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, **({"fused": True} if dev == "cuda" else {}))
    profiling = mode.endswith("-profile")
    mode = mode[:-len("-profile")] if profiling else mode
    run = torch.compile(model) if mode == "compile" else model

    def step(x):
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = loss_of(run, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    batch, x = 0, None
    for b in (int(s) for s in batches.split(",")):
        try:
            x = make_inputs(b)
            step(x)
            if dev == "cuda":
                torch.cuda.synchronize()
            batch = b
            break
        except torch.OutOfMemoryError:
            print(f"oom_at_batch {b}")
            opt.zero_grad(set_to_none=True)
            x = None
            torch.cuda.empty_cache()
    if not batch:
        print("no_batch_fits 1")
        sys.exit(1)
    for _ in range(4 if mode == "compile" else 2):
        step(x)
    if profiling:
        print(f"model {name}\nmode {mode}-profile\nbatch {batch}")
        profile(step, x, steps)
        return
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step(x)
    if dev == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1000 / steps
    tokens = batch * (seq + (dec_seq if kind == "t5" else 0))
    print(f"model {name}\nmode {mode}\nbatch {batch}\nseq {seq}\nparams {sum(p.numel() for p in params)}")
    print(f"ms_per_step {ms:.2f}\ntokens_per_s {1000 * tokens / ms:.0f}\nloss {loss.item():.4f}")
    if dev == "cuda":
        print(f"peak_mem_gb {torch.cuda.max_memory_allocated() / 1e9:.2f}")


if __name__ == "__main__":
    main()
