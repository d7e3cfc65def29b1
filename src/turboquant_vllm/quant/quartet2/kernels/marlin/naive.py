"""Plain PyTorch reference of the marlin path's GEMM (W4A16): the activations as they are, times the exact NVFP4
weight (code x scale x tensor scale), summed in float64.

kernels.marlin.marlin_linear is tested against it, whichever GEMM its token count picks (Marlin, the few-token
kernel, the decoded weight with cuBLAS).
"""

from __future__ import annotations

import torch

from ... import nvfp4
from ..dequantize.naive import unscaled_values


def w4a16_reference(x: torch.Tensor, weight: nvfp4.NVFP4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 (..., N): x (..., K) unquantized times W^T, W = code x scale x tensor scale (+ bias)."""
    y = (x.double() @ unscaled_values(weight.packed, weight.scales).double().t()) * weight.tensor_scale.double()
    return y + bias.double() if bias is not None else y
