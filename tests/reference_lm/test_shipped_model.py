"""The committed reference LM (models/reference-lm): size limits, loads as a plain Llama, retrieves."""

import json
from pathlib import Path

import torch

from reference_lm.passkey import PasskeyCodec, build_prompt

MODEL = Path(__file__).resolve().parents[2] / "models" / "reference-lm"


def test_shards_fit_the_size_limits():
    shards = sorted(MODEL.glob("model-*.safetensors"))
    assert shards and all(s.stat().st_size <= 16e6 for s in shards)
    assert sum(s.stat().st_size for s in shards) <= 48e6
    index = json.loads((MODEL / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    config = json.loads((MODEL / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["head_dim"] == 128
    assert config["num_attention_heads"] > config["num_key_value_heads"] and config["num_hidden_layers"] >= 6
    assert config["max_position_embeddings"] >= 4096


def test_loads_in_transformers_and_retrieves_a_pass_key():
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = LlamaForCausalLM.from_pretrained(MODEL, torch_dtype=torch.float32).eval()
    codec = PasskeyCodec.from_tokenizer(tok, tok.bos_token_id, tok.eos_token_id)
    # Filler the model never trained on: a public-domain-style paragraph repeated, tokenized here.
    filler = tok.encode("It was a bright cold day, and the clocks in the old house were striking the hour. " * 60,
                        add_special_tokens=False)
    hits = 0
    for key, depth in ((48213, 0.1), (70519, 0.5), (13377, 0.9)):
        ids, _ = build_prompt(codec, filler, key, 640, depth)
        out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)
        hits += tok.decode(out[0, len(ids):]).startswith(f" {key}")
    assert hits == 3
