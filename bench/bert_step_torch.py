"""Python PyTorch side of bench/bert_step.sh: the same BERT masked-LM (HF modeling_bert math,
written with torch.nn since transformers is not packaged in Debian 12), same batch, same
threads; prints 'ms_per_step <size> <value>'. Run with Debian's /usr/bin/python3 (torch 1.13)."""
import math, sys, time
import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES = {
    "tiny": dict(hidden=128, layers=2, heads=2, inter=512, batch=32),
    "base": dict(hidden=768, layers=12, heads=12, inter=3072, batch=8),
}
VOCAB, SEQ = 30522, 128


class Layer(nn.Module):
    def __init__(s, h, heads, inter):
        super().__init__()
        s.heads, s.hd = heads, h // heads
        s.q, s.k, s.v, s.o = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        s.ln1, s.ln2 = nn.LayerNorm(h, eps=1e-12), nn.LayerNorm(h, eps=1e-12)
        s.i, s.out = nn.Linear(h, inter), nn.Linear(inter, h)
        s.drop = nn.Dropout(0.1)

    def forward(s, x, mask):
        b, l, _ = x.shape
        sp = lambda t: t.view(b, l, s.heads, s.hd).transpose(1, 2)
        q, k, v = sp(s.q(x)), sp(s.k(x)), sp(s.v(x))
        a = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(s.hd) + mask
        a = s.drop(torch.softmax(a, -1))
        c = torch.matmul(a, v).transpose(1, 2).contiguous().view(b, l, -1)
        x = s.ln1(s.drop(s.o(c)) + x)
        return s.ln2(s.drop(s.out(F.gelu(s.i(x)))) + x)


class Bert(nn.Module):
    def __init__(s, h, layers, heads, inter):
        super().__init__()
        s.we, s.pe, s.te = nn.Embedding(VOCAB, h, padding_idx=0), nn.Embedding(512, h), nn.Embedding(2, h)
        s.ln, s.drop = nn.LayerNorm(h, eps=1e-12), nn.Dropout(0.1)
        s.layers = nn.ModuleList([Layer(h, heads, inter) for _ in range(layers)])
        s.td, s.tln = nn.Linear(h, h), nn.LayerNorm(h, eps=1e-12)
        s.bias = nn.Parameter(torch.zeros(VOCAB))

    def forward(s, ids, am, tt, labels):
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        x = s.drop(s.ln(s.we(ids) + s.pe(pos) + s.te(tt)))
        mask = (1.0 - am.float()[:, None, None, :]) * -10000.0
        for layer in s.layers:
            x = layer(x, mask)
        logits = F.linear(s.tln(F.gelu(s.td(x))), s.we.weight, s.bias)
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=-100)


def main():
    size, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if threads > 0:  # 0: as shipped (torch's own default)
        torch.set_num_threads(threads)
    print(f"threads {torch.get_num_threads()}", flush=True)
    torch.manual_seed(0)
    c = SIZES[size]
    model = Bert(c["hidden"], c["layers"], c["heads"], c["inter"])
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-4)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, VOCAB, (c["batch"], SEQ), generator=g)
    labels = torch.where(torch.rand(ids.shape, generator=g) < 0.15, ids, torch.full_like(ids, -100))
    am, tt = torch.ones_like(ids), torch.zeros_like(ids)

    def step():
        loss = model(ids, am, tt, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    step()  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    print(f"ms_per_step {size} {(time.perf_counter() - t0) * 1000 / steps:.2f}", flush=True)


if __name__ == "__main__":
    main()
