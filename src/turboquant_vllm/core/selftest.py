"""Self-test: the quantizer's measured distortion against the Lloyd-Max optimum and Shannon's bound."""

from __future__ import annotations

import torch

from .codebook import SUPPORTED_BITS, gaussian_limit_distortion, lloyd_max, shannon_bound
from .quantizer import Quantizer


def measured_distortion(bits: int, dim: int = 128, num_vectors: int = 20000, seed: int = 0) -> float:
    """E||x - dequant(quant(x))||^2 over random unit vectors x, through the real quantize/dequantize path."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_vectors, dim, generator=gen)
    x = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    q = Quantizer(bits, dim, norm_correction=False)  # the paper's MSE-optimal reconstruction
    x_hat = q.dequantize(*q.quantize(x))
    return float(((x - x_hat) ** 2).sum(-1).mean())


def distortion_table(dim: int = 128, num_vectors: int = 20000, seed: int = 0) -> list[dict]:
    """One row per bit width: measured MSE, the exact-marginal optimum, the Gaussian limit and the bound."""
    return [
        {
            "bits": b,
            "mse": measured_distortion(b, dim, num_vectors, seed),
            "lloyd_max": lloyd_max(b, dim).distortion,
            "gaussian_limit": gaussian_limit_distortion(b),
            "bound": shannon_bound(b),
        }
        for b in SUPPORTED_BITS
    ]
