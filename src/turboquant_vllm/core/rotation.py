"""A fixed random orthogonal matrix per (dim, seed): the TurboQuant rotation."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _rotation_cpu(dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    gauss = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)
    # Fix column signs so the matrix is Haar-distributed and does not depend on the QR backend.
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    return q.to(torch.float32).contiguous()


def rotation_matrix(dim: int, seed: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """R (dim, dim) fp32 with R @ R.T = I. Rotate a batch of row vectors with x @ R.T."""
    if dim < 1:
        raise ValueError(f"dim must be positive, got {dim}")
    return _rotation_cpu(dim, seed).to(device)

