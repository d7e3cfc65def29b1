"""Plain PyTorch reference of reading pages back: dequantize the records the store wrote.

ops.dequant.dequantize_pages is tested against it; ops.attention.naive reads the context through it.
"""

from __future__ import annotations

import torch

from ...core.calibration import KeyCalibration
from ...core.layout import CacheLayout
from ...core.presets import NORM_BYTES
from ..store.naive import quantizers


def read_kv_reference(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int, layout: CacheLayout, rotated: bool = False,
    key_calibration: KeyCalibration | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize the first num_tokens of the blocks block_ids -> K, V (num_tokens, kv_heads, head_dim) fp32; with
    the key calibration the keys were stored with, K holds the centered keys (key - mean) / scale
    (KeyCalibration.dequantize)."""
    kq, vq = quantizers(layout)
    bs, h = layout.block_size, layout.num_kv_heads
    pages = kv_cache[block_ids.long()]  # (blocks, kv_heads, head_page_bytes)

    def part(offset: int, record: int) -> torch.Tensor:
        raw = pages[:, :, offset : offset + bs * record].reshape(-1, h, bs, record)
        return raw.transpose(1, 2).reshape(-1, h, record)[:num_tokens]

    def norms(offset: int) -> torch.Tensor:
        return part(offset, NORM_BYTES).contiguous().view(torch.float32).squeeze(-1)

    k_codes, v_codes = part(0, layout.key_code_bytes), part(layout.value_code_offset, layout.value_code_bytes)
    k_norms, v_norms = norms(layout.key_norm_offset), norms(layout.value_norm_offset)
    if key_calibration is not None:
        k = key_calibration.dequantize(kq, k_codes, k_norms, rotated)
    elif rotated:
        k = kq.dequantize_rotated(k_codes, k_norms)
    else:
        k = kq.dequantize(k_codes, k_norms)
    v = vq.dequantize_rotated(v_codes, v_norms) if rotated else vq.dequantize(v_codes, v_norms)
    return k, v
