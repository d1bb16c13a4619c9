#!/usr/bin/python3
"""The PyTorch reference polytrain's HF-weights parity tests compare against.

usage: /usr/bin/python3 scripts/hf_parity.py MODEL_DIR INPUTS.safetensors OUT.safetensors

MODEL_DIR holds config.json + model.safetensors in Hugging Face's layout. The forward pass of
the family named by config.json's model_type is written in plain torch after transformers'
modeling_<family>.py (eval mode: no dropout), in scripts/hf_ref/<family>.py; inputs are the
tensors the family's forward takes (input_ids, attention_mask, ...). OUT gets `logits` (and
any other outputs the family returns), float32. Where transformers itself is installed (the
GPU machine), --transformers runs AutoModel's forward instead, for a check of the check.
"""
import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

from hf_ref.common import load_safetensors, save_safetensors  # noqa: E402

FAMILY = {"bert": "bert", "roberta": "bert", "albert": "albert", "gpt2": "gpt2", "t5": "t5"}


def with_transformers(model_dir, config, inputs):
    import transformers
    arch = {"bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM", "albert": "AlbertForMaskedLM",
            "gpt2": "GPT2LMHeadModel", "t5": "T5ForConditionalGeneration"}[config["model_type"]]
    model = getattr(transformers, arch).from_pretrained(model_dir).eval().float()
    return {"logits": model(**inputs).logits}


def main(argv):
    use_transformers = "--transformers" in argv
    args = [a for a in argv if a != "--transformers"]
    if len(args) != 3:
        sys.exit(__doc__)
    model_dir, inputs_path, out_path = args
    config = json.load(open(os.path.join(model_dir, "config.json")))
    inputs = load_safetensors(inputs_path)
    torch.manual_seed(0)
    with torch.no_grad():
        if use_transformers:
            out = with_transformers(model_dir, config, inputs)
        else:
            family = importlib.import_module("hf_ref." + FAMILY[config["model_type"]])
            weights = load_safetensors(os.path.join(model_dir, "model.safetensors"))
            weights = {k: v.float() for k, v in weights.items()}
            out = family.forward(config, weights, inputs)
    save_safetensors(out_path, {k: v.float() for k, v in out.items()})


if __name__ == "__main__":
    main(sys.argv[1:])
