#!/usr/bin/python3
"""Python side of bench/gpt2_step.sh: GPT-2 forward + backward tokens/s in Python PyTorch, the
model being HF's GPT2LMHeadModel math (scripts/hf_ref/gpt2.py, the parity tests' reference) with
its weights as leaf tensors; HF's shifted cross-entropy loss over dense logits.
usage: gpt2_step_torch.py small|tiny STEPS THREADS BATCH SEQ"""
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from hf_ref import gpt2  # noqa: E402


def main(size, steps, threads, batch, seq):
    if threads > 0:  # 0: as shipped (torch's own default)
        torch.set_num_threads(threads)
    print(f"threads {torch.get_num_threads()}", flush=True)
    torch.manual_seed(0)
    cfg = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12}
    if size == "tiny":
        cfg.update(n_embd=128, n_layer=2, n_head=2)
    e, v, n = cfg["n_embd"], cfg["vocab_size"], cfg["n_layer"]
    shapes = {"transformer.wte.weight": (v, e), "transformer.wpe.weight": (cfg["n_positions"], e),
              "transformer.ln_f.weight": (e,), "transformer.ln_f.bias": (e,)}
    for i in range(n):
        p = f"transformer.h.{i}."
        shapes.update({p + "ln_1.weight": (e,), p + "ln_1.bias": (e,), p + "ln_2.weight": (e,),
                       p + "ln_2.bias": (e,), p + "attn.c_attn.weight": (e, 3 * e), p + "attn.c_attn.bias": (3 * e,),
                       p + "attn.c_proj.weight": (e, e), p + "attn.c_proj.bias": (e,),
                       p + "mlp.c_fc.weight": (e, 4 * e), p + "mlp.c_fc.bias": (4 * e,),
                       p + "mlp.c_proj.weight": (4 * e, e), p + "mlp.c_proj.bias": (e,)})
    w = {k: (torch.randn(s) * 0.02).requires_grad_() for k, s in shapes.items()}
    ids = torch.randint(0, v, (batch, seq))

    def step():
        logits = gpt2.forward(cfg, w, {"input_ids": ids})["logits"]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1))
        loss.backward()
        for t in w.values():
            t.grad = None

    step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    ms = (time.perf_counter() - t0) * 1000 / steps
    print(f"ms_per_step {ms:.1f}\ntokens_per_s {1000.0 * batch * seq / ms:.1f}")
    print(f"peak_rss_mb {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f}")


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]))
