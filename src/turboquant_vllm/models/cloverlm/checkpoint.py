"""CloverLM checkpoints in the format of its HF release (config.json with CloverLM's fields, model.safetensors with
the names of reference.py, the head left out when tied): small random ones for the tests, a 4B-shaped one for speed.
(The NVFP4 variant, packed fp4 + `_scale` + `_scale_2`, is not written yet.)"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .reference import CloverLMShape


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
