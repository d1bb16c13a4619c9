"""GPT2LMHeadModel's forward (transformers' modeling_gpt2.py, eager attention, eval mode) in
plain torch, from an HF config dict and state dict."""
import torch
import torch.nn.functional as F

from hf_ref.common import ACT2FN


def forward(config, w, inputs):
    p = "transformer." if "transformer.wte.weight" in w else ""
    n_embd = config.get("n_embd", config.get("hidden_size", 768))
    n_head = config.get("n_head", config.get("num_attention_heads", 12))
    n_layer = config.get("n_layer", config.get("num_hidden_layers", 12))
    eps = config.get("layer_norm_epsilon", 1e-5)
    act = ACT2FN[config.get("activation_function", "gelu_new")]
    head_dim = n_embd // n_head

    ids = inputs["input_ids"]
    b, l = ids.shape
    mask = inputs.get("attention_mask")
    x = w[p + "wte.weight"][ids] + w[p + "wpe.weight"][torch.arange(l)][None]
    causal = torch.tril(torch.ones(l, l, dtype=torch.bool))[None, None]
    if mask is not None:
        allowed = causal & mask.bool()[:, None, None, :]
    else:
        allowed = causal

    def conv1d(t, name):  # HF Conv1D: weight [in, out]
        return t @ w[name + ".weight"] + w[name + ".bias"]

    def ln(t, name):
        return F.layer_norm(t, (n_embd,), w[name + ".weight"], w[name + ".bias"], eps)

    for i in range(n_layer):
        h = f"{p}h.{i}."
        a = ln(x, h + "ln_1")
        q, k, v = conv1d(a, h + "attn.c_attn").split(n_embd, dim=2)
        q, k, v = (t.view(b, l, n_head, head_dim).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2)
        if config.get("scale_attn_weights", True):
            scores = scores / torch.full([], v.size(-1) ** 0.5)
        if config.get("scale_attn_by_inverse_layer_idx", False):
            scores = scores / float(i + 1)
        scores = torch.where(allowed, scores, torch.tensor(torch.finfo(scores.dtype).min))
        probs = torch.softmax(scores, dim=-1)
        ctx = (probs @ v).transpose(1, 2).reshape(b, l, n_embd)
        x = x + conv1d(ctx, h + "attn.c_proj")
        m = ln(x, h + "ln_2")
        x = x + conv1d(act(conv1d(m, h + "mlp.c_fc")), h + "mlp.c_proj")
    x = ln(x, p + "ln_f")
    head = w["lm_head.weight"] if not config.get("tie_word_embeddings", True) else w[p + "wte.weight"]
    return {"logits": x @ head.t()}
