"""quartet2's Blackwell path: weights and activations in NVFP4 (W4A4) on the FP4 tensor cores, through vLLM's own
CUTLASS NVFP4 GEMM (vllm._custom_ops.cutlass_scaled_fp4_mm, sm100+). A thin adapter: the weight is converted to the
kernel's layout once at load, the activations are quantized per row by our quantizer (kernels.quantize, the 4/6 rule,
the same codes the emulation multiplies) on each call. No Blackwell GPU has run it: the CPU tests replace the kernel
by naive.cutlass_scaled_fp4_mm_reference, a float64 reference of its contract.

The kernel's contract (vLLM 0.33, csrc/quantization/fp4/nvfp4_scaled_mm_*.cu; FlashInfer's mm_fp4 takes the same):
    a, b            uint8 (M, K / 2) and (N, K / 2): E2M1 codes, element 2i in the low nibble (ours as they are);
                    K and N multiples of 32
    block_scale_a/b float8_e4m3fn (round_up(M or N, 128), round_up(K / 16, 4)), swizzled in tiles of 128 rows x 4
                    groups (the tcgen05 scale-factor layout, which is cuBLAS's blocked layout: nvfp4.blocked)
    alpha           fp32, one value
    out             (M, N) bf16 / fp16 only: alpha x the fp32 sums of code x scale products, rounded once.
One alpha cannot hold our scales: the activations have a tensor scale per row (never one across the batch), a fused
layer's weight one per part. So alpha is the weight's global scale (marlin.to_vllm_nvfp4: the tensor scale, or for
parts a power of two with an exact per-column ratio) times 2^-11, which keeps the sums of activation units (up to
1536) inside fp16; each output row is then multiplied by its tensor scale x 2^11 (and each column by its ratio) in
fp32. The output is rounded twice (the kernel's, then the product's) where the emulation rounds once: within one unit
in the last place of bf16 / fp16 of it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ... import nvfp4
from ...nvfp4 import NVFP4Weight
from ...nvfp4.blocked import round_up, swizzle_scales
from ..marlin import to_vllm_nvfp4
from ..quantize import quantize

ALIGN = 32  # the kernel's K and N
UNIT_SHIFT = 2.0 ** 11  # >= 1536 = an activation's largest magnitude in units of its row's tensor scale
DTYPES = (torch.bfloat16, torch.float16)


def available(capability: int | None) -> bool:
    """Whether vLLM's CUTLASS NVFP4 GEMM runs on this GPU: FP4 tensor cores (sm100+) and a vLLM build with it."""
    if capability is None or capability < 100:
        return False
    try:
        from vllm import _custom_ops as ops

        return bool(ops.cutlass_scaled_mm_supports_fp4(capability))
    except (ImportError, AttributeError, RuntimeError):  # a vLLM built without its CUDA kernels (torch.ops._C)
        return False


class W4A4Weight(NamedTuple):
    weight: torch.Tensor  # uint8 (round_up(N, 32), round_up(K, 32) / 2), zero-padded codes
    weight_scale: torch.Tensor  # float8_e4m3fn, swizzle_scales of the padded (N, K / 16) scales
    alpha: torch.Tensor  # fp32 (1,): the global scale / 2^11
    channel_scale: torch.Tensor | None  # fp32 (N,): each column's tensor scale / the global one; None: all 1
    size_n: int
    size_k: int


def prepare(w: NVFP4Weight) -> W4A4Weight:
    """NVFP4Weight -> the kernel's layout, once at load: every code and block scale as they are."""
    v = to_vllm_nvfp4(w)
    n, k = v.weight.shape[0], 2 * v.weight.shape[1]
    pad_n, pad_k = round_up(n, ALIGN) - n, round_up(k, ALIGN) - k
    codes = torch.nn.functional.pad(v.weight, (0, pad_k // 2, 0, pad_n))  # zero codes add nothing to the sums
    scales = torch.nn.functional.pad(v.weight_scale.view(torch.uint8), (0, pad_k // nvfp4.GROUP, 0, pad_n))
    alpha = (v.weight_global_scale.to(torch.float32) / UNIT_SHIFT).reshape(1)  # by a power of two: exact
    return W4A4Weight(codes.contiguous(), swizzle_scales(scales.view(torch.float8_e4m3fn)), alpha, v.channel_scale,
                      n, k)


def w4a4_linear(x: torch.Tensor, w: W4A4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) with x (..., K) quantized per row to NVFP4 and the GEMM on the FP4 tensor cores; y in x's
    dtype (bf16 / fp16). kernels.emulate.emulated_linear is its exact-arithmetic twin."""
    from vllm import _custom_ops as ops

    if x.dtype not in DTYPES:
        raise ValueError(f"the NVFP4 GEMM writes bf16 or fp16, got {x.dtype} activations")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m = x2.shape[0]
    if m == 0:
        return x.new_empty((*shape[:-1], w.size_n))
    packed, scales, row_scale = quantize(x2.contiguous(), per_row=True)
    pad_k = w.weight.shape[1] * 2 - w.size_k
    if pad_k:
        packed = torch.nn.functional.pad(packed, (0, pad_k // 2))
        scales = torch.nn.functional.pad(scales.view(torch.uint8), (0, pad_k // nvfp4.GROUP)).view(scales.dtype)
    out = ops.cutlass_scaled_fp4_mm(packed, w.weight, swizzle_scales(scales), w.weight_scale, w.alpha, x.dtype)
    y = out[:, :w.size_n].to(torch.float32) * (row_scale * UNIT_SHIFT)
    if w.channel_scale is not None:
        y = y * w.channel_scale
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*shape[:-1], w.size_n)
