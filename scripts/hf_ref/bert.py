"""BERT / RoBERTa masked-LM forward in plain torch, after transformers' modeling_bert.py and
modeling_roberta.py (BertForMaskedLM / RobertaForMaskedLM, eval mode: no dropout).

forward(config, weights, inputs) -> {"logits": [B, L, V]}; weights are the HF state_dict
(bert.* + cls.predictions.* or roberta.* + lm_head.*); a missing decoder weight is tied to
the word embeddings, as transformers ties it."""
import math

import torch
import torch.nn.functional as F

from hf_ref.common import ACT2FN

# BertConfig's defaults (RobertaConfig: pad_token_id 1, vocab_size 50265).
DEFAULTS = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "hidden_act": "gelu",
            "layer_norm_eps": 1e-12, "pad_token_id": 0}


def _cfg(config, key):
    if key == "pad_token_id" and config.get("model_type") == "roberta":
        return config.get(key, 1)
    return config.get(key, DEFAULTS[key])


def linear(w, prefix, x):
    return F.linear(x, w[prefix + ".weight"], w.get(prefix + ".bias"))


def layer_norm(w, prefix, x, eps):
    return F.layer_norm(x, (x.shape[-1],), w[prefix + ".weight"], w[prefix + ".bias"], eps)


def _position_ids(config, input_ids):
    if config.get("model_type") == "roberta":
        # create_position_ids_from_input_ids: padding keeps padding_idx, the rest count from it + 1
        pad = _cfg(config, "pad_token_id")
        mask = input_ids.ne(pad).int()
        return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + pad
    return torch.arange(input_ids.shape[1]).unsqueeze(0).expand_as(input_ids)


def embeddings(w, prefix, ids, types, positions, eps):
    """word + token_type + position embeddings, then LayerNorm (BertEmbeddings / AlbertEmbeddings)."""
    x = (F.embedding(ids, w[prefix + ".word_embeddings.weight"]) +
         F.embedding(types, w[prefix + ".token_type_embeddings.weight"]) +
         F.embedding(positions, w[prefix + ".position_embeddings.weight"]))
    return layer_norm(w, prefix + ".LayerNorm", x, eps)


def extended_mask(attention):
    """get_extended_attention_mask: [B, L] 1/0 -> [B, 1, 1, L] additive (current transformers
    uses the dtype's minimum, not -10000)."""
    return (1.0 - attention[:, None, None, :].float()) * torch.finfo(torch.float32).min


def attention_context(w, prefixes, x, mask, heads):
    """Scaled dot-product self-attention of BertSelfAttention / AlbertAttention: the query, key
    and value projections named by `prefixes`, heads split, softmax over keys -> [B, L, H]."""
    b, l, h = x.shape
    d = h // heads

    def split(t):
        return t.view(b, l, heads, d).permute(0, 2, 1, 3)

    q, k, v = (split(linear(w, p, x)) for p in prefixes)
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d) + mask
    return torch.matmul(torch.softmax(scores, dim=-1), v).permute(0, 2, 1, 3).reshape(b, l, h)


def encoder_layer(w, p, x, mask, config):
    eps = _cfg(config, "layer_norm_eps")
    names = [p + ".attention.self." + n for n in ("query", "key", "value")]
    ctx = attention_context(w, names, x, mask, _cfg(config, "num_attention_heads"))
    a = layer_norm(w, p + ".attention.output.LayerNorm", linear(w, p + ".attention.output.dense", ctx) + x, eps)
    inter = ACT2FN[_cfg(config, "hidden_act")](linear(w, p + ".intermediate.dense", a))
    return layer_norm(w, p + ".output.LayerNorm", linear(w, p + ".output.dense", inter) + a, eps)


def forward(config, weights, inputs):
    roberta = config.get("model_type") == "roberta"
    base = "roberta" if roberta else "bert"
    w = weights
    ids = inputs["input_ids"].long()
    attention = inputs.get("attention_mask", torch.ones_like(ids))
    types = inputs.get("token_type_ids", torch.zeros_like(ids)).long()
    eps = _cfg(config, "layer_norm_eps")

    e = base + ".embeddings"
    x = embeddings(w, e, ids, types, _position_ids(config, ids), eps)
    mask = extended_mask(attention)
    for i in range(_cfg(config, "num_hidden_layers")):
        x = encoder_layer(w, f"{base}.encoder.layer.{i}", x, mask, config)

    act = ACT2FN[_cfg(config, "hidden_act")]
    if roberta:  # RobertaLMHead: dense, gelu (always), layer_norm, decoder
        hdn = layer_norm(w, "lm_head.layer_norm", F.gelu(linear(w, "lm_head.dense", x)), eps)
        head = "lm_head"
    else:  # BertLMPredictionHead: transform (dense, hidden_act, LayerNorm), decoder
        hdn = layer_norm(w, "cls.predictions.transform.LayerNorm",
                          act(linear(w, "cls.predictions.transform.dense", x)), eps)
        head = "cls.predictions"
    decoder = w.get(head + ".decoder.weight", w[e + ".word_embeddings.weight"])
    return {"logits": F.linear(hdn, decoder, w[head + ".bias"])}
