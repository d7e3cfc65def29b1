"""CloverLM checkpoints in the format of its HF release (config.json with CloverLM's fields, model.safetensors with
the names of reference.py, the head left out when tied): small random ones for the tests, a 4B-shaped one for speed.

write_nvfp4_checkpoint: the NVFP4 variant CloverLM's converter writes (convert_checkpoint.py --nvfp4), in the format
quant.quartet2.plugin.checkpoint reads: each block linear's weight as packed E2M1 codes, `<name>_scale` (E4M3,
blocked) and `<name>_scale_2` (the fp32 tensor scale), the rest in bf16, and hf_quant_config.json (vLLM then picks
quartet2 by itself). write_tokenizer: a small byte-level BPE tokenizer with a chat template, so test checkpoints can
be served.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .reference import CloverLMShape

# the block linears the converter quantizes (2-D weights other than the embedding and the head)
NVFP4_LINEARS = ("mhsa.lq.weight", "mhsa.lk.weight", "mhsa.lv.weight", "mhsa.lo.weight", "mlp.l1.0.weight",
                 "mlp.l2.weight")
EOS = "<|endoftext|>"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def config_of(shape: CloverLMShape) -> dict:
    """config.json as CloverLM's configuration class writes it, the derived HF fields included."""
    return {"architectures": ["CloverLMForCausalLM"], "model_type": "cloverlm", "vocab_size": shape.vocab_size,
            "num_blocks": shape.num_blocks, "heads": shape.heads, "d_head": shape.d_head, "ratio": shape.ratio,
            "scale_type": "1/sqrt(d)", "max_context": shape.max_context, "quartet_2_impl": shape.quartet_2_impl,
            "weight_tying": shape.weight_tying, "tie_word_embeddings": shape.weight_tying, "attn_backend": "pytorch",
            "num_hidden_layers": shape.num_blocks, "hidden_size": shape.d, "intermediate_size": shape.d_ff,
            "max_position_embeddings": shape.max_context, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads, "head_dim": shape.d_head, "torch_dtype": "bfloat16"}


def write_checkpoint(shape: CloverLMShape, weights: dict[str, torch.Tensor], out_dir: str | Path) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_of(shape), indent=2) + "\n")
    tensors = {k: v.contiguous() for k, v in weights.items()
               if not (shape.weight_tying and k == "transformer.linear.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def read_checkpoint(model_dir: str | Path) -> tuple[CloverLMShape, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    path = Path(model_dir)
    shape = CloverLMShape.from_config(json.loads((path / "config.json").read_text()))
    return shape, load_file(str(path / "model.safetensors"))


def nvfp4_quant_config() -> dict:
    """hf_quant_config.json as CloverLM's converter writes it."""
    from ...quant.quartet2 import nvfp4
    from ...quant.quartet2.plugin.checkpoint import PRODUCER

    return {"producer": {"name": PRODUCER, "version": "1.0"},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": nvfp4.GROUP,
                             "exclude_modules": ["emb", "linear"]}}


def write_nvfp4_checkpoint(shape: CloverLMShape, weights: dict[str, torch.Tensor], out_dir: str | Path) -> Path:
    """The block linears quantized by quartet2's reference quantizer (one tensor scale per weight, the 4/6 rule),
    their scales blocked as cuBLAS lays them out; every linear must fill whole 128-row x 64-column scale tiles (the
    converter's padded shapes are unreadable, so they are refused here too)."""
    from ...quant.quartet2 import nvfp4
    from ...quant.quartet2.nvfp4.blocked import block_scales

    tensors = {}
    for name, w in weights.items():
        if not name.endswith(NVFP4_LINEARS):
            tensors[name] = w
            continue
        q = nvfp4.quantize(w.float())
        tensors[name] = nvfp4.pack(q.codes).view(torch.float4_e2m1fn_x2)
        tensors[f"{name}_scale"] = block_scales(q.scales)
        tensors[f"{name}_scale_2"] = q.tensor_scale.reshape(())
    out = write_checkpoint(shape, tensors, out_dir)
    (out / "hf_quant_config.json").write_text(json.dumps(nvfp4_quant_config(), indent=2) + "\n")
    return out


def write_tokenizer(out_dir: str | Path, vocab_size: int, max_length: int = 1024) -> Path:
    """tokenizer.json (byte-level BPE trained here on a few hundred words: any text encodes, nothing decodes to an
    unknown) and tokenizer_config.json (EOS, a plain chat template) that AutoTokenizer loads offline. It has exactly
    vocab_size tokens (fillers added when training stops short), so every id a model samples decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 300:
        raise ValueError(f"a byte-level tokenizer needs 256 byte tokens and some merges: vocab_size {vocab_size} < 300")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fillers = vocab_size - tok.get_vocab_size()
    if fillers > 0:
        tok.add_tokens([f"<filler_{i}>" for i in range(fillers)])
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS, "bos_token": None,
              "model_max_length": max_length, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _corpus() -> list[str]:
    """A few hundred words: an English paragraph and syllable words from a fixed seed, lines of ten words."""
    import random

    text = ("The capital of France is Paris . Large language models are trained on text to predict the next word . "
            "In the year two thousand and thirty , the sea was calm and the sky was blue . Write a short poem about "
            "the river , the mountain and the city . What is the answer ? Explain it in one sentence please .").split()
    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "si", "po", "de", "va", "gu", "re", "an", "or", "el", "is"]
    words = text + ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    return [" ".join(words[i:i + 10]) for i in range(0, len(words), 10)]
