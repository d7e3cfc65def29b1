"""Randomized paged-cache fixtures shared by the kernel tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from turboquant_vllm.core.calibration import KeyCalibration
from turboquant_vllm.core.layout import CacheLayout
from turboquant_vllm.core.presets import get_preset


@dataclass
class PagedBatch:
    layout: CacheLayout
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    keys: torch.Tensor  # (total context tokens, kv_heads, d) in sequence order
    values: torch.Tensor
    slot_mapping: torch.Tensor  # slot of every context token


def make_paged_batch(gen, preset, head_dim, kv_heads, block_size, seq_lens, dtype, device) -> PagedBatch:
    """Random K/V for every context token, scattered over a shuffled set of pages."""
    layout = CacheLayout(get_preset(preset), head_dim, kv_heads, block_size)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few pages nobody owns
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    slots, used = [], 0
    for i, n in enumerate(seq_lens):
        table[i, : blocks_per_seq[i]] = perm[used : used + blocks_per_seq[i]]
        used += blocks_per_seq[i]
        pos = torch.arange(n)
        slots.append(table[i, pos // block_size].long() * block_size + pos % block_size)
    total = sum(seq_lens)
    # Keys with a mean offset and varied scales, like real models' keys.
    keys = torch.randn(total, kv_heads, head_dim, generator=gen) * torch.rand(total, kv_heads, 1, generator=gen) * 4
    keys = keys + torch.randn(1, kv_heads, head_dim, generator=gen)
    values = torch.randn(total, kv_heads, head_dim, generator=gen)
    # Poison: garbage bytes everywhere, so reading an unwritten slot cannot pass unnoticed.
    cache = torch.randint(0, 256, layout.cache_shape(num_blocks), generator=gen, dtype=torch.uint8)
    return PagedBatch(
        layout, cache.to(device), table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
        keys.to(dtype).to(device), values.to(dtype).to(device), torch.cat(slots).to(device),
    )


def random_calibration(gen, kv_heads: int, head_dim: int, device) -> KeyCalibration:
    """A key calibration with a real mean offset and scales spread over 1/4 .. 4."""
    mean = torch.randn(kv_heads, head_dim, generator=gen)
    scale = torch.exp(torch.empty(kv_heads, head_dim).uniform_(-1.4, 1.4, generator=gen))
    return KeyCalibration(mean, scale).to(device)


def keys_with_sinks(gen, keys: torch.Tensor, cal: KeyCalibration, sinks: list[int]) -> torch.Tensor:
    """Keys for a calibrated cache that stores both kinds in one sequence: the ordinary ones around the calibration's
    mean (stored centered), the tokens at sinks like attention sinks: small and far from the mean (stored
    uncentered); the first sink exactly zero."""
    out = keys.float().cpu() + cal.mean.cpu()
    out[sinks] = 0.1 * torch.randn(len(sinks), *keys.shape[1:], generator=gen)
    out[sinks[0]] = 0.0
    return out.to(keys.dtype).to(keys.device)
