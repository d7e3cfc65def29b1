"""Byte layout of the paged, compressed KV cache.

The cache of one layer is a uint8 tensor (num_blocks, num_kv_heads, head_page_bytes). One block
of one KV head is contiguous, so an attention program (one sequence, one KV head) reads
contiguous bytes:

    [K codes of block_size tokens][K norms (fp32)][V codes of block_size tokens][V norms (fp32)]
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .presets import NORM_BYTES, Preset

MIN_HEAD_DIM, MAX_HEAD_DIM = 32, 256


@dataclass(frozen=True)
class CacheLayout:
    preset: Preset
    head_dim: int
    num_kv_heads: int
    block_size: int

    def __post_init__(self) -> None:
        d = self.head_dim
        if d % 16 or not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
            raise ValueError(
                f"TurboQuant supports head_dim a multiple of 16 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], "
                f"got {d}; use another attention backend for this model"
            )
        if self.block_size % 4 or self.block_size < 4:
            raise ValueError(f"block_size must be a positive multiple of 4, got {self.block_size}")
        if self.num_kv_heads < 1:
            raise ValueError(f"num_kv_heads must be positive, got {self.num_kv_heads}")

    @property
    def key_code_bytes(self) -> int:
        return self.preset.key_record_bytes(self.head_dim) - NORM_BYTES

    @property
    def value_code_bytes(self) -> int:
        return self.preset.value_record_bytes(self.head_dim) - NORM_BYTES

    # Offsets inside one (block, head) page.
    @property
    def key_norm_offset(self) -> int:
        return self.block_size * self.key_code_bytes

    @property
    def value_code_offset(self) -> int:
        return self.key_norm_offset + self.block_size * NORM_BYTES

    @property
    def value_norm_offset(self) -> int:
        return self.value_code_offset + self.block_size * self.value_code_bytes

    @property
    def head_page_bytes(self) -> int:
        return self.value_norm_offset + self.block_size * NORM_BYTES

    @property
    def page_bytes(self) -> int:
        return self.num_kv_heads * self.head_page_bytes

    @property
    def bytes_per_token_per_head(self) -> int:
        return self.preset.bytes_per_token_per_head(self.head_dim)

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int]:
        return (num_blocks, self.num_kv_heads, self.head_page_bytes)


@functools.lru_cache(maxsize=None)
def cache_layout(preset: Preset, head_dim: int, num_kv_heads: int, block_size: int) -> CacheLayout:
    """The layout of these dimensions, built (and validated) once per process."""
    return CacheLayout(preset, head_dim, num_kv_heads, block_size)


def layout_of_cache(preset: Preset, head_dim: int, cache_shape: tuple[int, ...]) -> CacheLayout:
    """The layout a cache tensor of cache_shape (num_blocks, num_kv_heads, head_page_bytes) was made with."""
    per_token = preset.bytes_per_token_per_head(head_dim)
    if len(cache_shape) != 3 or cache_shape[-1] % per_token:
        raise ValueError(
            f"KV cache of shape {tuple(cache_shape)} was not laid out for preset {preset.name} at "
            f"head_dim {head_dim} ({per_token} B per token per head)"
        )
    return cache_layout(preset, head_dim, cache_shape[1], cache_shape[-1] // per_token)
