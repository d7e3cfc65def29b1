"""Plain PyTorch reference of the store: quantize keys/values with core's quantizers into their page slots.

Slow and simple on purpose: ops.store.store_kv is tested against it (bit-exact up to fp32 rounding of the rotation).
"""

from __future__ import annotations

import torch

from ...core.calibration import KeyCalibration
from ...core.layout import CacheLayout
from ...core.presets import NORM_BYTES
from ...core.quantizer import Quantizer


def quantizers(layout: CacheLayout) -> tuple[Quantizer, Quantizer]:
    return Quantizer(layout.preset.k_bits, layout.head_dim), Quantizer(layout.preset.v_bits, layout.head_dim)


def _norm_bytes(norms: torch.Tensor) -> torch.Tensor:
    return norms.contiguous().view(torch.uint8).reshape(*norms.shape, NORM_BYTES)


def store_kv_reference(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, layout: CacheLayout,
    key_calibration: KeyCalibration | None = None,
) -> None:
    """Quantize key/value (tokens, kv_heads, head_dim) and write each token into its slot (-1: skip).

    With a key calibration the cache holds the calibrated keys: per token the shorter of (key - mean) / scale and
    key / scale, the latter with its norm negated (KeyCalibration.quantize)."""
    kq, vq = quantizers(layout)
    if key_calibration is None:
        k_codes, k_norms = kq.quantize(key)
    else:
        k_codes, k_norms = key_calibration.quantize(kq, key)
    v_codes, v_norms = vq.quantize(value)
    keep = slot_mapping[: key.shape[0]] >= 0
    slots = slot_mapping[: key.shape[0]][keep].long()
    block, offset = slots // layout.block_size, slots % layout.block_size
    heads = torch.arange(layout.num_kv_heads, device=kv_cache.device)
    flat = kv_cache.view(-1)
    for start, records in (
        (0, k_codes),
        (layout.key_norm_offset, _norm_bytes(k_norms)),
        (layout.value_code_offset, v_codes),
        (layout.value_norm_offset, _norm_bytes(v_norms)),
    ):
        size = records.shape[-1]
        # byte r of token t, head h -> block * page + h * head_page + start + offset * size + r
        index = (
            block[:, None, None] * kv_cache.stride(0)
            + heads[None, :, None] * kv_cache.stride(1)
            + start
            + offset[:, None, None] * size
            + torch.arange(size, device=kv_cache.device)[None, None, :]
        )
        flat[index.reshape(-1)] = records[keep].reshape(-1)
