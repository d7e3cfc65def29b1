"""NVFP4 linear layers emulated exactly (quartet2's any-GPU path): weights quantized once (one tensor scale),
activations per row by the same 4/6 rule, then one matmul over the dequantized values.

A code times its E4M3 group scale has at most 7 significant bits, so it is exact in bf16 and every product of two is
exact in fp32: a matmul over these values with fp32 sums (dequantize.exact_products: bf16 tensor cores on a GPU)
computes the W4A4 tensor cores' products exactly and differs from them only in the order of the sums. The two tensor
scales (the activation row's and the weight's) multiply the result, as an FP4 GEMM's epilogue does.
"""

from __future__ import annotations

import torch

from ...nvfp4 import NVFP4Weight
from ..dequantize import exact_products
from ..quantize import quantize


def emulated_linear(x: torch.Tensor, weight: NVFP4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) with x and W both in NVFP4, x (..., K) quantized per row: W4A4's numerics; y in x's dtype.
    naive.w4a4_reference is the reference."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    packed, scales, row_scale = quantize(x2.contiguous(), per_row=True)
    acc = exact_products(packed, scales, weight.packed, weight.scales)
    y = acc * (row_scale * weight.tensor_scale)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*shape[:-1], -1)
