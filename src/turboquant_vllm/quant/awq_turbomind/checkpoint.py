"""AWQ checkpoints (AutoAWQ's GEMM format) of our own making, for the tests and benchmarks of the AWQ paths:

- quantize_checkpoint: a trained Llama-family model (HF directory, safetensors) with every decoder linear layer
  quantized by round-to-nearest int4 (awq_format.quantize; AutoAWQ's format, not its scale search);
- random_checkpoint: a Llama-family model of any shape with random codes, for speed (no fp weights needed).

Both write config.json with AutoAWQ's quantization_config, so vLLM's `awq` / `awq_marlin` and `awq_turbomind` load
them alike.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from . import awq_format as awq

# The decoder's linear layers AutoAWQ quantizes (Llama, Qwen2, Mistral naming)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "generation_config.json", "chat_template.jinja")


def quantization_config(group_size: int, modules_to_not_convert: list[str] | None = None) -> dict:
    """What AutoAWQ writes into config.json for a 4-bit GEMM checkpoint."""
    return {"quant_method": "awq", "bits": awq.BITS, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": modules_to_not_convert or None}


def is_quantized(name: str, tensor: torch.Tensor, skip: list[str]) -> bool:
    module = name.removesuffix(".weight")
    return (name.endswith(".weight") and tensor.dim() == 2 and module.rsplit(".", 1)[-1] in LINEARS
            and not any(s in module for s in skip))


def _awq_tensors(prefix: str, w: awq.AWQWeight) -> dict[str, torch.Tensor]:
    return {f"{prefix}.qweight": w.qweight, f"{prefix}.qzeros": w.qzeros, f"{prefix}.scales": w.scales}


def _write(out_dir: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    return out_dir


def quantize_checkpoint(src_dir: str | Path, out_dir: str | Path, group_size: int = 128,
                        modules_to_not_convert: list[str] | None = None) -> Path:
    """src_dir's model with each decoder linear layer's weight (N, K) replaced by AWQ tensors of W = weight.T; every
    other tensor and the tokenizer files copied as they are."""
    from safetensors import safe_open

    src, out = Path(src_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    skip = list(modules_to_not_convert or [])
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if not is_quantized(name, t, skip):
                    tensors[name] = t
                    continue
                n, k = t.shape
                if k % group_size or n % awq.PACK:
                    raise ValueError(f"{name} ({n} x {k}): AWQ needs in_features a multiple of the group size "
                                     f"{group_size} and out_features a multiple of {awq.PACK}; choose a group size "
                                     f"dividing {k} or add the module to modules_to_not_convert")
                tensors.update(_awq_tensors(name.removesuffix(".weight"), awq.quantize(t.T.float(), group_size)))
    if not any(name.endswith(".qweight") for name in tensors):
        raise ValueError(f"no linear layer of {src} to quantize (looked for {', '.join(LINEARS)})")
    config["quantization_config"] = quantization_config(group_size, skip)
    config["torch_dtype"] = "float16"  # AutoAWQ's kernels and scales are fp16
    _write(out, config, tensors)
    for name in COPIED_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


def random_checkpoint(config: dict, out_dir: str | Path, group_size: int = 128, seed: int = 0) -> Path:
    """A Llama-family model (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM) of config's shape: random
    uniform codes, zero point 8 and a step giving weights of std ~0.02 in every decoder linear layer; normal(0, 0.02)
    embeddings and head, unit norms; Qwen2's q / k / v biases zero."""
    gen = torch.Generator().manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // heads
    step = 0.02 / 4.6  # uniform codes 0..15 minus 8 have std ~4.6

    def linear(k: int, n: int) -> awq.AWQWeight:
        if k % group_size:
            raise ValueError(f"in_features {k} is not a multiple of the group size {group_size}")
        codes = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
        zeros = torch.full((k // group_size, n), 8, dtype=torch.int32)
        return awq.AWQWeight(awq.pack(codes), awq.pack(zeros), torch.full((k // group_size, n), step).half())

    tensors = {"model.embed_tokens.weight": (torch.randn(config["vocab_size"], h, generator=gen) * 0.02).half(),
               "model.norm.weight": torch.ones(h, dtype=torch.float16)}
    if not config.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = (torch.randn(config["vocab_size"], h, generator=gen) * 0.02).half()
    shapes = {"self_attn.q_proj": (h, heads * d), "self_attn.k_proj": (h, kv_heads * d),
              "self_attn.v_proj": (h, kv_heads * d), "self_attn.o_proj": (heads * d, h),
              "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter), "mlp.down_proj": (inter, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
        for name, (k, n) in shapes.items():
            tensors.update(_awq_tensors(f"{p}.{name}", linear(k, n)))
        if config.get("model_type") == "qwen2":
            for name in ("q_proj", "k_proj", "v_proj"):
                tensors[f"{p}.self_attn.{name}.bias"] = torch.zeros(shapes[f"self_attn.{name}"][1],
                                                                    dtype=torch.float16)
    config = dict(config, torch_dtype="float16", quantization_config=quantization_config(group_size))
    return _write(Path(out_dir), config, tensors)
