"""NVFP4 codes and block scales -> their values code x scale (the tensor scale left out), one Triton kernel: what
naive.unscaled_values (its plain-PyTorch reference) gives, bit for bit, for the emulation's matmul.

A value has at most 6 significant bits and lies in [2^-10, 2688], so it is exact in bf16, fp16 and fp32: the
emulation multiplies bf16 values on the tensor cores with fp32 sums (every product exact) instead of an fp32 matmul of
fp32 copies, and never keeps more than the packed weight between calls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import nvfp4
from .naive import unscaled_values

BLOCK_ROWS, BLOCK_COLS = 16, 128


@triton.jit
def e2m1_value(code):
    """E2M1 codes (int32: sign << 3 | magnitude index) -> their fp32 values: the code's bits placed in fp16's bits 15
    and 11..9 make its value * 2^-14."""
    half = (((code & 7) << 9) | ((code & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)
    return half.to(tl.float32) * 16384.0


@triton.jit
def _values_kernel(packed_ptr, scales_ptr, out_ptr, R, K, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    k = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (r[:, None] < R) & (k[None, :] < K)
    row = r[:, None].to(tl.int64)
    byte = tl.load(packed_ptr + row * (K // 2) + k[None, :] // 2, mask=mask, other=0).to(tl.int32)
    code = (byte >> ((k[None, :] % 2) * 4)) & 15
    # a non-negative E4M3 byte (4 exponent bits, 3 mantissa bits) shifted into fp16's bits 14..7 is its value * 2^-8
    byte = tl.load(scales_ptr + row * (K // 16) + k[None, :] // 16, mask=mask, other=0).to(tl.int16)
    scale = (byte << 7).to(tl.float16, bitcast=True)
    value = e2m1_value(code) * scale.to(tl.float32) * 256.0
    tl.store(out_ptr + row * K + k[None, :], value.to(out_ptr.dtype.element_ty), mask=mask)


def values_triton(packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (R, K) <- code x scale of packed (R, K / 2) codes and (R, K / 16) E4M3 scales (non-negative, as the
    quantizer makes them), in out's dtype."""
    rows, k = out.shape
    if tuple(packed.shape) != (rows, k // 2) or tuple(scales.shape) != (rows, k // nvfp4.GROUP):
        raise ValueError(f"codes {tuple(packed.shape)} and scales {tuple(scales.shape)} do not fit {tuple(out.shape)}")
    grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(k, BLOCK_COLS))
    _values_kernel[grid](packed, scales.view(torch.uint8), out, rows, k, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS)
    return out


def exact_products(x_packed: torch.Tensor, x_scales: torch.Tensor, w_packed: torch.Tensor,
                   w_scales: torch.Tensor) -> torch.Tensor:
    """fp32 (M, N): the sums of code x scale products of activations (M, K) and weights (N, K), every product exact:
    on a GPU bf16 values on the tensor cores with fp32 sums; elsewhere an fp32 matmul of the reference's values."""
    if not x_packed.is_cuda:
        return unscaled_values(x_packed, x_scales) @ unscaled_values(w_packed, w_scales).t()
    k = 2 * x_packed.shape[1]
    xv = values_triton(x_packed, x_scales, x_packed.new_empty((x_packed.shape[0], k), dtype=torch.bfloat16))
    wv = values_triton(w_packed, w_scales, w_packed.new_empty((w_packed.shape[0], k), dtype=torch.bfloat16))
    return torch.mm(xv, wv.t(), out_dtype=torch.float32)
