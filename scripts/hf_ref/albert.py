"""ALBERT forward in plain torch, after transformers' modeling_albert.py (AlbertForMaskedLM, and
AlbertForPreTraining when the checkpoint has its sop_classifier; eval mode: no dropout).

forward(config, weights, inputs) -> {"logits": [B, L, V]} (+ "sop_logits": [B, 2]); a missing
predictions.decoder.weight is tied to the word embeddings, as transformers ties it."""
import torch
import torch.nn.functional as F

from hf_ref.bert import attention_context, embeddings, extended_mask, layer_norm, linear
from hf_ref.common import ACT2FN

# AlbertConfig's defaults
DEFAULTS = {"hidden_size": 4096, "num_hidden_layers": 12, "num_hidden_groups": 1, "num_attention_heads": 64,
            "inner_group_num": 1, "hidden_act": "gelu_new", "layer_norm_eps": 1e-12}


def _cfg(config, key):
    return config.get(key, DEFAULTS[key])


def albert_layer(w, p, x, mask, config):
    """AlbertLayer: AlbertAttention (projection, residual, LayerNorm inside), then the
    feed-forward ffn -> act -> ffn_output, residual and full_layer_layer_norm."""
    eps = _cfg(config, "layer_norm_eps")
    names = [p + ".attention." + n for n in ("query", "key", "value")]
    ctx = attention_context(w, names, x, mask, _cfg(config, "num_attention_heads"))
    a = layer_norm(w, p + ".attention.LayerNorm", x + linear(w, p + ".attention.dense", ctx), eps)
    f = linear(w, p + ".ffn_output", ACT2FN[_cfg(config, "hidden_act")](linear(w, p + ".ffn", a)))
    return layer_norm(w, p + ".full_layer_layer_norm", f + a, eps)


def forward(config, weights, inputs):
    w = weights
    ids = inputs["input_ids"].long()
    attention = inputs.get("attention_mask", torch.ones_like(ids))
    types = inputs.get("token_type_ids", torch.zeros_like(ids)).long()
    eps = _cfg(config, "layer_norm_eps")
    e = "albert.embeddings"
    x = embeddings(w, e, ids, types, torch.arange(ids.shape[1]).unsqueeze(0), eps)
    mask = extended_mask(attention)

    # AlbertTransformer: project to hidden_size, then layer i runs group int(i / (L / G))
    x = linear(w, "albert.encoder.embedding_hidden_mapping_in", x)
    n_layers, n_groups = _cfg(config, "num_hidden_layers"), _cfg(config, "num_hidden_groups")
    for i in range(n_layers):
        g = int(i / (n_layers / n_groups))
        for j in range(_cfg(config, "inner_group_num")):
            x = albert_layer(w, f"albert.encoder.albert_layer_groups.{g}.albert_layers.{j}", x, mask, config)

    # AlbertMLMHead: dense (hidden -> embedding), act, LayerNorm, decoder (+ predictions.bias)
    hdn = ACT2FN[_cfg(config, "hidden_act")](linear(w, "predictions.dense", x))
    hdn = layer_norm(w, "predictions.LayerNorm", hdn, eps)
    decoder = w.get("predictions.decoder.weight", w[e + ".word_embeddings.weight"])
    out = {"logits": F.linear(hdn, decoder, w["predictions.bias"])}
    if "sop_classifier.classifier.weight" in w:
        pooled = torch.tanh(linear(w, "albert.pooler", x[:, 0]))
        out["sop_logits"] = linear(w, "sop_classifier.classifier", pooled)
    return out
