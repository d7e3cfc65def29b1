"""Plain PyTorch reference of the quantize kernel: Quartet II's rule (nvfp4.four_six) with the kernel's outputs.

kernels.quantize.quantize is tested against it, bit for bit.
"""

from __future__ import annotations

import torch

from ... import nvfp4


def quantize_reference(x: torch.Tensor, tensor_scale: torch.Tensor | None = None,
                       per_row: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) -> (packed codes uint8 (M, K / 2), E4M3 scales (M, K / 16), fp32 tensor scale: as given, else (M, 1)
    per row, else a scalar), what quantize returns for the same arguments."""
    q = nvfp4.quantize(x.float(), tensor_scale, per_row)
    return nvfp4.pack(q.codes), q.scales, q.tensor_scale
