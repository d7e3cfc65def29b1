"""Plain PyTorch reference of the marlin path's weight decoder: Marlin's NVFP4 words and scale bytes read back by
the probed tables (marlin_layout.tables), one gather per code and scale.

kernels.marlin_dequant.dequantize is tested against it, bit for bit.
"""

from __future__ import annotations

import torch

from ... import nvfp4
from ..marlin_layout import TILE_K, TILE_N, MarlinTables


def dequantize_reference(codes: torch.Tensor, scale_bytes: torch.Tensor, t: MarlinTables, n: int,
                         k: int) -> torch.Tensor:
    """fp32 (n, k): code * fp16(byte << 7) * 2^-7 of Marlin's codes (int32) and scale bytes, in plain PyTorch."""
    padded_n = scale_bytes.shape[1]
    kk, nn = torch.meshgrid(torch.arange(k, device=codes.device), torch.arange(n, device=codes.device), indexing="xy")
    word = t.word.long()[kk % TILE_K, nn % TILE_N] + kk // TILE_K * 2 * padded_n + nn // TILE_N * 128
    shift = t.shift.long()[kk % TILE_K, nn % TILE_N]
    code = (codes.reshape(-1).long().gather(0, word.reshape(-1)).reshape(n, k) >> shift) & 15
    value = nvfp4.e2m1_value(code)
    column = nn // TILE_N * TILE_N + t.scale_column.long()[nn % TILE_N]
    byte = scale_bytes.view(torch.uint8).reshape(-1).long().gather(0, (kk // TILE_K * padded_n + column).reshape(-1))
    scale = (byte.to(torch.int16) << 7).view(torch.float16).to(torch.float32).reshape(n, k)
    return value * scale / 128
