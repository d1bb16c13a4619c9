"""T5ForConditionalGeneration's forward pass in plain torch, after transformers'
models/t5/modeling_t5.py (eval mode, no cache): T5LayerNorm (RMS, fp32 variance), bucketed
relative position bias computed by block 0 of each stack and shared, unscaled attention with
finfo.min masks, T5DenseActDense / T5DenseGatedActDense, d_model**-0.5 rescaling before a tied
lm_head. Written independently of polytrain's C++ (src/models/t5.cpp); it is the reference."""
import math

import torch

from hf_ref.common import ACT2FN


def _activation(config):
    proj = config.get("feed_forward_proj", "relu")
    parts = proj.split("-")
    gated = parts[0] == "gated"
    name = "gelu_new" if proj == "gated-gelu" else parts[-1]
    return ACT2FN[name], gated


def _layer_norm(w, x, eps):
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    if w.dtype in (torch.float16, torch.bfloat16):
        x = x.to(w.dtype)
    return w * x


def _bucket(relative_position, bidirectional, num_buckets, max_distance):
    buckets = 0
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    if_large = max_exact + (
        torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    if_large = torch.min(if_large, torch.full_like(if_large, num_buckets - 1))
    return buckets + torch.where(is_small, relative_position, if_large)


def _position_bias(table, q_len, k_len, bidirectional, config):
    context = torch.arange(q_len, dtype=torch.long)[:, None]
    memory = torch.arange(k_len, dtype=torch.long)[None, :]
    buckets = _bucket(memory - context, bidirectional, config.get("relative_attention_num_buckets", 32),
                      config.get("relative_attention_max_distance", 128))
    return torch.nn.functional.embedding(buckets, table).permute([2, 0, 1]).unsqueeze(0)


def _attention(w, prefix, x, kv, bias, config):
    b = x.shape[0]
    h, d = config.get("num_heads", 8), config.get("d_kv", 64)

    def heads(t):
        return t.view(b, -1, h, d).transpose(1, 2)

    q = heads(x @ w[prefix + "q.weight"].t())
    k = heads(kv @ w[prefix + "k.weight"].t())
    v = heads(kv @ w[prefix + "v.weight"].t())
    scores = torch.matmul(q, k.transpose(3, 2))
    scores += bias
    probs = torch.softmax(scores.float(), dim=-1).type_as(scores)
    out = torch.matmul(probs, v).transpose(1, 2).contiguous().view(b, -1, h * d)
    return out @ w[prefix + "o.weight"].t()


def _ff(w, prefix, x, config):
    act, gated = _activation(config)
    p = prefix + "DenseReluDense."
    if gated:
        h = act(x @ w[p + "wi_0.weight"].t()) * (x @ w[p + "wi_1.weight"].t())
    else:
        h = act(x @ w[p + "wi.weight"].t())
    return h @ w[p + "wo.weight"].t()


def _stack(w, name, config, embeds, self_mask, n_layers, enc=None, enc_mask=None):
    eps = config.get("layer_norm_epsilon", 1e-6)
    decoder = name == "decoder"
    x = embeds
    position_bias = None
    cross_bias = None
    for i in range(n_layers):
        p = f"{name}.block.{i}.layer."
        # self-attention; block 0 builds the bias (+ mask) that the later blocks reuse
        normed = _layer_norm(w[p + "0.layer_norm.weight"], x, eps)
        if position_bias is None:
            table = w[f"{name}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
            position_bias = _position_bias(table, x.shape[1], x.shape[1], not decoder, config) + self_mask
        x = x + _attention(w, p + "0.SelfAttention.", normed, normed, position_bias, config)
        if decoder:
            normed = _layer_norm(w[p + "1.layer_norm.weight"], x, eps)
            if cross_bias is None:
                h = config.get("num_heads", 8)
                cross_bias = torch.zeros((1, h, x.shape[1], enc.shape[1]), dtype=x.dtype) + enc_mask
            x = x + _attention(w, p + "1.EncDecAttention.", normed, enc, cross_bias, config)
        f = p + ("2." if decoder else "1.")
        x = x + _ff(w, f, _layer_norm(w[f + "layer_norm.weight"], x, eps), config)
    return _layer_norm(w[f"{name}.final_layer_norm.weight"], x, eps)


def forward(config, weights, inputs):
    w = dict(weights)
    if "shared.weight" not in w:
        w["shared.weight"] = w.get("encoder.embed_tokens.weight", w.get("decoder.embed_tokens.weight"))
    shared = w["shared.weight"]
    ids, dec_ids = inputs["input_ids"].long(), inputs["decoder_input_ids"].long()
    mask = inputs.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(ids)
    dtype = shared.dtype
    fmin = torch.finfo(dtype).min
    # encoder: padding mask [B, 1, 1, L]; the same inverted mask serves the cross-attention
    enc_mask = (1.0 - mask[:, None, None, :].to(dtype)) * fmin
    n_enc = config.get("num_layers", 6)
    n_dec = config.get("num_decoder_layers") or n_enc
    enc = _stack(w, "encoder", config, shared[ids], enc_mask, n_enc)
    # decoder: causal mask (no decoder_attention_mask, as in T5ForConditionalGeneration's default)
    t = dec_ids.shape[1]
    causal = torch.triu(torch.full((t, t), fmin, dtype=dtype), diagonal=1)
    causal = causal * (torch.arange(t) > torch.arange(t).reshape(-1, 1))
    causal = causal[None, None, :, :].expand(ids.shape[0], 1, -1, -1)
    dec = _stack(w, "decoder", config, shared[dec_ids], causal, n_dec, enc, enc_mask)
    if config.get("tie_word_embeddings", True):
        dec = dec * (config.get("d_model", 512) ** -0.5)
        logits = dec @ shared.t()
    else:
        logits = dec @ w["lm_head.weight"].t()
    return {"logits": logits, "encoder_last_hidden_state": enc}
