"""TurboQuant-MSE quantize / dequantize of a batch of vectors: fp32 norm + packed b-bit codes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codebook import Codebook, codebook
from .packing import pack_codes, record_bytes, unpack_codes
from .rotation import rotation_matrix


@dataclass(frozen=True)
class Quantizer:
    """Everything needed to quantize vectors of one head_dim at one bit width."""

    bits: int
    dim: int
    seed: int = 0
    # Store ||x|| / ||value[codes]||, so the reconstruction keeps the exact norm: Lloyd-Max shrinks
    # vectors (E||x_hat||^2 = (1 - MSE) ||x||^2), which flattens attention. False: the paper's MSE quantizer.
    norm_correction: bool = True

    @property
    def codebook(self) -> Codebook:
        return codebook(self.bits, self.dim)

    @property
    def record_bytes(self) -> int:
        return record_bytes(self.dim, self.bits)

    def rotation(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return rotation_matrix(self.dim, self.seed, device)

    def boundaries(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor(self.codebook.boundaries, dtype=torch.float32, device=device)

    def code_values(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Value of each sign-magnitude code (2^bits,), the dequantization lookup table."""
        return torch.tensor(self.codebook.signed_values(), dtype=torch.float32, device=device).to(dtype)

    def encode_rotated(self, y: torch.Tensor) -> torch.Tensor:
        """Codes (..., dim) int32 of rotated unit vectors y: sign bit + count of boundaries below |y|."""
        mags = (y.abs().unsqueeze(-1) > self.boundaries(y.device)).sum(-1, dtype=torch.int32)
        sign = (y < 0).to(torch.int32) << (self.bits - 1)
        return sign | mags

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (..., dim) -> (packed codes (..., record_bytes) uint8, stored norms (...) fp32)."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"expected vectors of dim {self.dim}, got shape {tuple(x.shape)}")
        xf = x.float()
        norms = torch.linalg.vector_norm(xf, dim=-1)
        rotated = xf @ self.rotation(x.device).T
        # A zero vector has no direction: any code works since its norm scales it back to zero.
        y = rotated / torch.where(norms > 0, norms, 1.0).unsqueeze(-1)
        codes = self.encode_rotated(y)
        if self.norm_correction:  # no code is 0.0, so the reconstruction's norm is > 0
            norms = norms / torch.linalg.vector_norm(self.code_values(x.device)[codes.long()], dim=-1)
        return pack_codes(codes, self.bits), norms

    def dequantize_rotated(self, packed: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """The reconstruction in the rotated basis: norm * value[code], fp32."""
        codes = unpack_codes(packed, self.bits, self.dim).long()
        return self.code_values(packed.device)[codes] * norms.unsqueeze(-1)

    def dequantize(self, packed: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """The reconstruction in the original basis, fp32."""
        return self.dequantize_rotated(packed, norms) @ self.rotation(packed.device)
