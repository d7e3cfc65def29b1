"""A Llama-architecture LM in plain PyTorch, saved so that HF and vLLM `LlamaForCausalLM` load it as is.

Module names equal the HF weight names; RoPE uses HF's convention (rotate_half, non-interleaved);
the output head is tied to the embedding. Needs only torch: the safetensors writer is built in.
"""

import json
import math
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelConfig:
    vocab_size: int = 8192
    hidden_size: int = 512
    intermediate_size: int = 1024
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 128
    max_position_embeddings: int = 4096
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5

    def hf_config(self, bos_id: int, eos_id: int) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **asdict(self),
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "tie_word_embeddings": True,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "initializer_range": 0.02,
            "use_cache": True,
            "dtype": "bfloat16",
        }


def rope_cos_sin(cfg: ModelConfig, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """HF Llama's default RoPE tables, fp32, [seq_len, head_dim]: each frequency twice (halves, not pairs)."""
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim)
    freqs = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # HF casts the tables to the activations' dtype
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, kv_hook=None):
        """kv_hook(k, v) -> (k, v): what a KV cache would hand back for K (post-RoPE) and V, [B, kv_heads, T, d]."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_hook is not None:
            k, v = kv_hook(k, v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, kv_hook=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_hook)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.config = c
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.model.layers = nn.ModuleList(Block(c) for _ in range(c.num_hidden_layers))
        self.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def init_weights(self, std: float = 0.02):
        """Normal(0, std); the projections that write into the residual stream scaled by 1/sqrt(2 * layers)."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            else:
                into_residual = name.endswith(("o_proj.weight", "down_proj.weight"))
                scale = 1 / math.sqrt(2 * self.config.num_hidden_layers) if into_residual else 1
                nn.init.normal_(p, 0.0, std * scale)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] ids (position 0 first) -> [B, T, vocab] logits."""
        cos, sin = rope_cos_sin(self.config, input_ids.shape[1], input_ids.device)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return F.linear(self.model.norm(x), self.model.embed_tokens.weight)


# --- saving in HF format ---------------------------------------------------------------------------

SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
MAX_SHARD_BYTES = 15_000_000
HEADER_ROOM = 1 << 16  # bytes kept free in each shard for its JSON header


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The safetensors format: u64 little-endian header size, JSON header (8-byte aligned), raw bytes."""
    header, offset = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        dtype = SAFETENSORS_DTYPES[t.dtype]
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors.values():
            f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def plan_shards(sizes: dict[str, int], max_bytes: int = MAX_SHARD_BYTES) -> list[list[str]]:
    """Group tensor names, in order, into shards of at most max_bytes (header room included)."""
    shards, used = [[]], 0
    for name, n in sizes.items():
        if n + HEADER_ROOM > max_bytes:
            raise ValueError(f"{name} ({n} bytes) does not fit in a {max_bytes}-byte shard")
        if shards[-1] and used + n + HEADER_ROOM > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    return shards


def save_hf(model: Llama, out: Path, bos_id: int, eos_id: int, dtype=torch.bfloat16) -> list[Path]:
    """Sharded safetensors + index, config.json and generation_config.json. Returns the shard paths."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    shards = plan_shards({k: v.numel() * v.element_size() for k, v in state.items()})
    paths, weight_map = [], {}
    for i, names in enumerate(shards):
        path = out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(path, {k: state[k] for k in names})
        weight_map.update({k: path.name for k in names})
        paths.append(path)
    total = sum(v.numel() * v.element_size() for v in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(model.config.hf_config(bos_id, eos_id), indent=2) + "\n")
    gen = {"bos_token_id": bos_id, "eos_token_id": eos_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return paths
