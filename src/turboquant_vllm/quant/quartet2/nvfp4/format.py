"""The NVFP4 format in plain PyTorch: what every quartet2 path reads and writes.

A tensor x (..., K), K a multiple of 16, is held as
    codes   E2M1 values in {0, 0.5, 1, 1.5, 2, 3, 4, 6} with a sign, one per element (sign in bit 3, the magnitude's
            index in bits 0..2), packed two a byte, element 2i in the low nibble;
    scales  one E4M3 scale per group of 16 consecutive elements of the last axis;
    tensor_scale  fp32: one for the tensor (weights), one per row (activations), or one per output row (a fused
                  layer's parts, each with its own),
and x ~ code * scale * tensor_scale. How the codes and scales are chosen: four_six (Quartet II's rule). Every rounding
to E2M1 is to nearest, ties to even (e2m1_round).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

GROUP = 16
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of code i (E2M1: 1 exponent-bias, 1 mantissa)
# Midpoints between neighbouring magnitudes and where a tie goes (the neighbour with an even mantissa):
# 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)


class NVFP4(NamedTuple):
    """Unpacked: what the reference quantizer gives."""

    codes: torch.Tensor  # uint8 (..., K): sign in bit 3, magnitude index (into E2M1_VALUES) in bits 0..2
    scales: torch.Tensor  # float8_e4m3fn (..., K / 16)
    tensor_scale: torch.Tensor  # fp32: a scalar, or (..., 1) per row


class NVFP4Weight(NamedTuple):
    """Packed: a linear layer's weight (N, K) as the kernels take it."""

    packed: torch.Tensor  # uint8 (N, K / 2): E2M1 codes, element 2i in the low nibble
    scales: torch.Tensor  # float8_e4m3fn (N, K / 16)
    tensor_scale: torch.Tensor  # fp32 scalar, or (N,): one per output row (fused parts of their own scales)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel() + 4


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """fp32 y -> E2M1 codes (uint8: sign << 3 | magnitude index), magnitudes rounded to nearest, ties to even,
    clipped to 6."""
    a = y.abs()
    index = torch.zeros_like(a, dtype=torch.uint8)
    for mid, up in zip(_MIDPOINTS, _TIE_UP):
        index += (a >= mid if up else a > mid).to(torch.uint8)
    return index | ((y < 0) & (index > 0)).to(torch.uint8) << 3  # -0 is stored as 0


def e2m1_value(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes -> their fp32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    value = table[(codes & 7).long()]
    return torch.where(codes & 8 > 0, -value, value)


def dequantize(q: NVFP4) -> torch.Tensor:
    """code * scale * tensor_scale in fp32."""
    ts = q.tensor_scale.unsqueeze(-1) if q.tensor_scale.dim() else q.tensor_scale
    step = q.scales.to(torch.float32).unsqueeze(-1) * ts
    return (e2m1_value(q.codes).reshape(*q.codes.shape[:-1], -1, GROUP) * step).reshape(q.codes.shape)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (..., K) -> uint8 (..., K / 2), element 2i in the low nibble (NVFP4's byte order)."""
    return codes[..., 0::2] | codes[..., 1::2] << 4


def unpack(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)
