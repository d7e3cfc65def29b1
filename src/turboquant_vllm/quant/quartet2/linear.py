"""NVFP4 linear layers emulated exactly (quartet2's any-GPU path): weights quantized once (one tensor scale),
activations per row by the same 4/6 rule, then one matmul over the dequantized values.

A code times its E4M3 group scale has at most 7 significant bits, so it is exact in bf16 and every product of two is
exact in fp32: a matmul over these values with fp32 sums (dequantize.exact_products: bf16 tensor cores on a GPU)
computes the W4A4 tensor cores' products exactly and differs from them only in the order of the sums. The two tensor
scales (the activation row's and the weight's) multiply the result, as an FP4 GEMM's epilogue does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import nvfp4
from .dequantize import exact_products
from .quantize import quantize


class NVFP4Weight(NamedTuple):
    packed: torch.Tensor  # uint8 (N, K / 2): E2M1 codes, element 2i in the low nibble
    scales: torch.Tensor  # float8_e4m3fn (N, K / 16)
    tensor_scale: torch.Tensor  # fp32 scalar, or (N,): one per output row (fused parts of their own scales)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel() + 4


def quantize_weight(weight: torch.Tensor) -> NVFP4Weight:
    """nn.Linear's weight (N, K) -> NVFP4 with one tensor scale: K / 2 + K / 16 bytes a row instead of 2 K (bf16)."""
    packed, scales, ts = quantize(weight.contiguous())
    return NVFP4Weight(packed, scales, ts)


def quantize_parts(weight: torch.Tensor, parts: list[int]) -> NVFP4Weight:
    """A fused layer's weight (its parts' rows stacked, e.g. q / k / v) -> NVFP4 with one tensor scale per part, as
    the model's own linears (and their NVFP4 checkpoints) are quantized: the tensor scale repeated over each part's
    rows. One part: quantize_weight."""
    if len(parts) <= 1:
        return quantize_weight(weight)
    pieces = [quantize_weight(w) for w in weight.split(parts, dim=0)]
    rows = torch.cat([q.tensor_scale.reshape(1).expand(n) for q, n in zip(pieces, parts)])
    return NVFP4Weight(torch.cat([q.packed for q in pieces]), torch.cat([q.scales for q in pieces]), rows)


def unscaled_values(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """code x group scale (the tensor scale left out) of packed (R, K / 2) codes: exact in bf16 and fp32."""
    step = scales.to(torch.float32).repeat_interleave(nvfp4.GROUP, dim=-1)
    return (nvfp4.e2m1_value(nvfp4.unpack(packed)) * step).to(dtype)


def emulated_linear(x: torch.Tensor, weight: NVFP4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) with x and W both in NVFP4, x (..., K) quantized per row: W4A4's numerics; y in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    packed, scales, row_scale = quantize(x2.contiguous(), per_row=True)
    acc = exact_products(packed, scales, weight.packed, weight.scales)
    y = acc * (row_scale * weight.tensor_scale)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*shape[:-1], -1)
