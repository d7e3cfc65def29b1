"""Plain PyTorch reference of the W4A4 GEMM: the activations quantized per row by Quartet II's rule, both operands
dequantized, multiplied and summed in float64.

kernels.emulate.emulated_linear is tested against it (and kernels.w4a4.w4a4_linear against the emulation).
"""

from __future__ import annotations

import torch

from ... import nvfp4
from ..dequantize.naive import unscaled_values


def w4a4_reference(x: torch.Tensor, weight: nvfp4.NVFP4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 (..., N): x (..., K) quantized per row, times W^T, both as code x scale x tensor scale (+ bias)."""
    shape = x.shape
    xq = nvfp4.quantize(x.reshape(-1, shape[-1]).float(), per_row=True)
    w = unscaled_values(weight.packed, weight.scales).double() * weight.tensor_scale.double().reshape(-1, 1)
    y = nvfp4.dequantize(xq).double() @ w.t()
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*shape[:-1], -1)
