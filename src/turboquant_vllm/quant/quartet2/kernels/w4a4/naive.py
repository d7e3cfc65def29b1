"""Plain PyTorch reference of the GEMM the w4a4 path calls, vLLM's CUTLASS NVFP4 GEMM
(vllm._custom_ops.cutlass_scaled_fp4_mm): float64 sums of code x scale products, times alpha, rounded once.

The CPU tests run kernels.w4a4.w4a4_linear with it in the kernel's place (no Blackwell GPU has run the path).
"""

from __future__ import annotations

import torch

from ... import nvfp4
from ...nvfp4.blocked import unswizzle_scales


def cutlass_scaled_fp4_mm_reference(a: torch.Tensor, b: torch.Tensor, block_scale_a: torch.Tensor,
                                    block_scale_b: torch.Tensor, alpha: torch.Tensor,
                                    out_dtype: torch.dtype) -> torch.Tensor:
    """alpha x A B^T in out_dtype for codes a (M, K / 2), b (N, K / 2) and their swizzled E4M3 scales
    (nvfp4.blocked.swizzle_scales)."""
    k = 2 * a.shape[1]

    def values(codes: torch.Tensor, swizzled: torch.Tensor) -> torch.Tensor:
        scales = unswizzle_scales(swizzled, codes.shape[0], k // nvfp4.GROUP).double()
        return nvfp4.e2m1_value(nvfp4.unpack(codes)).double() * scales.repeat_interleave(nvfp4.GROUP, dim=1)

    return (values(a, block_scale_a) @ values(b, block_scale_b).t() * alpha.double()).to(out_dtype)
