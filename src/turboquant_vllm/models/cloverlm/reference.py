"""CloverLM in plain PyTorch, as the trained model computes it: the reference for the vLLM port.

Per block: Q, K, V, O without bias (K, V for heads / ratio KV heads); RoPE with base 1024 on interleaved pairs
(coordinates 2i, 2i + 1), then the L2 ("sphere") normalization of every head of Q and K; Q times a learned per-head
scale (initialised to sqrt(d_head)); softmax scale 1.0, causal; post-sublayer RMSNorm, x = x + norm(attn(x)),
x = x + norm(mlp(x)); the MLP d -> 4 d, ReLU^2, -> d, no gate. A final RMSNorm and the head, tied to the embedding.
The RMSNorms are torch.nn.RMSNorm(d) with epsilon left to torch: the epsilon of the type torch computes the norm in,
fp32 for bf16 and fp32 inputs alike (at::opmath_type), so NORM_EPS = 2^-23, not the 1e-6 of other ports.

Checkpoint names (model.safetensors): transformer.emb.weight, transformer.blocks.{i}.mhsa.{lq,lk,lv,lo}.weight,
transformer.blocks.{i}.mhsa.scale (1, heads, 1, 1), transformer.blocks.{i}.out_att_norm.weight,
transformer.blocks.{i}.mlp.l1.0.weight, transformer.blocks.{i}.mlp.l2.weight,
transformer.blocks.{i}.out_mlp_norm.weight, transformer.out_norm.weight, transformer.linear.weight (the
embedding's when tied).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ROPE_BASE = 1024.0
NORM_EPS = torch.finfo(torch.float32).eps

@dataclass(frozen=True)
class CloverLMShape:
    vocab_size: int
    num_blocks: int
    heads: int
    d_head: int
    ratio: int  # query heads per KV head
    max_context: int
    weight_tying: bool = True
    quartet_2_impl: str | None = "quartet2"

    @property
    def d(self) -> int:
        return self.heads * self.d_head

    @property
    def kv_heads(self) -> int:
        return self.heads // self.ratio

    @property
    def d_ff(self) -> int:
        return 4 * self.d

    def __post_init__(self) -> None:
        if self.heads % self.ratio or self.d_head % 2:
            raise ValueError(f"CloverLM needs heads ({self.heads}) a multiple of ratio ({self.ratio}) and an even "
                             f"d_head ({self.d_head})")

    @classmethod
    def from_config(cls, config: dict) -> CloverLMShape:
        """From CloverLM's config.json fields (num_blocks, heads, d_head, ratio, max_context, weight_tying,
        quartet_2_impl)."""
        return cls(config["vocab_size"], config["num_blocks"], config["heads"], config["d_head"], config["ratio"],
                   config["max_context"], config.get("weight_tying", True), config.get("quartet_2_impl"))


def rope_tables(positions: torch.Tensor, d_head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (len(positions), d_head) fp32, every angle repeated for its pair of coordinates."""
    j = torch.arange(d_head // 2, dtype=torch.float32, device=positions.device)
    theta = 1.0 / ROPE_BASE ** (2.0 * j / d_head)
    phi = positions.to(torch.float32)[:, None] * theta[None, :]
    return phi.cos().repeat_interleave(2, dim=-1), phi.sin().repeat_interleave(2, dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[2i], x[2i+1]) of x (..., tokens, d_head) by the tokens' angles."""
    turned = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return x * cos + turned * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def forward(weights: dict[str, torch.Tensor], shape: CloverLMShape, ids: torch.Tensor) -> torch.Tensor:
    """Logits (tokens, vocab) in fp32 for one sequence of token ids, every weight taken in fp32."""
    w = {k: v.to(torch.float32) for k, v in weights.items()}
    t = ids.shape[0]
    cos, sin = rope_tables(torch.arange(t, device=ids.device), shape.d_head)
    x = w["transformer.emb.weight"][ids]
    for i in range(shape.num_blocks):
        p = f"transformer.blocks.{i}"
        q = (x @ w[f"{p}.mhsa.lq.weight"].T).view(t, shape.heads, shape.d_head).transpose(0, 1)
        k = (x @ w[f"{p}.mhsa.lk.weight"].T).view(t, shape.kv_heads, shape.d_head).transpose(0, 1)
        v = (x @ w[f"{p}.mhsa.lv.weight"].T).view(t, shape.kv_heads, shape.d_head).transpose(0, 1)
        q = F.normalize(apply_rope(q, cos, sin), dim=-1) * w[f"{p}.mhsa.scale"].view(shape.heads, 1, 1)
        k = F.normalize(apply_rope(k, cos, sin), dim=-1)
        k, v = k.repeat_interleave(shape.ratio, dim=0), v.repeat_interleave(shape.ratio, dim=0)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = (q @ k.transpose(1, 2)).masked_fill(causal, float("-inf"))
        attn = (scores.softmax(dim=-1) @ v).transpose(0, 1).reshape(t, shape.d)
        x = x + rms_norm(attn @ w[f"{p}.mhsa.lo.weight"].T, w[f"{p}.out_att_norm.weight"], NORM_EPS)
        h = F.relu(x @ w[f"{p}.mlp.l1.0.weight"].T) ** 2
        x = x + rms_norm(h @ w[f"{p}.mlp.l2.weight"].T, w[f"{p}.out_mlp_norm.weight"], NORM_EPS)
    x = rms_norm(x, w["transformer.out_norm.weight"], NORM_EPS)
    head = w.get("transformer.linear.weight", w["transformer.emb.weight"])
    return x @ head.T


def random_weights(shape: CloverLMShape, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A model of this shape initialised as CloverLM initialises it (linears and embedding normal(0, 0.02), norms
    1, Q scales sqrt(d_head)), with the norms perturbed (x (1 + 0.1 normal)) so a test sees them act."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*size, std=0.02):
        return (torch.randn(*size, generator=gen) * std).to(dtype)

    d, kv = shape.d, shape.kv_heads * shape.d_head
    w = {"transformer.emb.weight": normal(shape.vocab_size, d),
         "transformer.out_norm.weight": (1 + normal(d, std=0.1).float()).to(dtype)}
    for i in range(shape.num_blocks):
        p = f"transformer.blocks.{i}"
        w.update({f"{p}.mhsa.lq.weight": normal(d, d), f"{p}.mhsa.lk.weight": normal(kv, d),
                  f"{p}.mhsa.lv.weight": normal(kv, d), f"{p}.mhsa.lo.weight": normal(d, d),
                  f"{p}.mhsa.scale": torch.full((1, shape.heads, 1, 1), math.sqrt(shape.d_head), dtype=dtype),
                  f"{p}.out_att_norm.weight": (1 + normal(d, std=0.1).float()).to(dtype),
                  f"{p}.mlp.l1.0.weight": normal(shape.d_ff, d), f"{p}.mlp.l2.weight": normal(d, shape.d_ff),
                  f"{p}.out_mlp_norm.weight": (1 + normal(d, std=0.1).float()).to(dtype)})
    if not shape.weight_tying:
        w["transformer.linear.weight"] = normal(shape.vocab_size, d)
    return w
