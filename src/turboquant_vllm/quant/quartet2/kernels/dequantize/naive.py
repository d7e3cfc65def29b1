"""Plain PyTorch reference of the dequantize kernel: NVFP4 codes times their group scales.

kernels.dequantize.values_triton is tested against it, bit for bit; exact_products against float64 sums of it.
"""

from __future__ import annotations

import torch

from ... import nvfp4


def unscaled_values(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """code x group scale (the tensor scale left out) of packed (R, K / 2) codes: exact in bf16 and fp32."""
    step = scales.to(torch.float32).repeat_interleave(nvfp4.GROUP, dim=-1)
    return (nvfp4.e2m1_value(nvfp4.unpack(packed)) * step).to(dtype)
