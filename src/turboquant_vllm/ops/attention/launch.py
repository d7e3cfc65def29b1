"""The decode launch policy, decided here only: which kernel, warps, pipeline stages, registers and split count.

Measured on the H200 (benchmarks/results/kernel_variants/h200-decode-tables-stages-launch.log at commit 98a39d8); the
vLLM backend and the benchmarks ask this module, never a copy of their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...core.layout import CacheLayout
from ...core.presets import Preset
from ..rotation.rotation import SPREAD, SPREAD_ROWS
from ..utils import next_pow2

NUM_SMS_FALLBACK = 132  # an H100 / H200, where no device can be asked (CPU runs)
# Splits of one sequence's context: up to 32, each of at least 256 tokens (8 tiles of 32), so a short context leaves
# the splits past it empty (partials of zero weight). H100
# (benchmarks/results/kernel_variants/ at commit 98a39d8): the floor takes 11% off d 256, 16 x 2k
# (0.1691 -> 0.1500 ms) and is neutral where splits hold >= 256 tokens anyway. One sequence takes up to 64 splits:
# H100 (h100-tq4-one-sequence-policy.md) 1 x 128k 0.1274 -> 0.0844 ms at d 128, 0.0824 -> 0.0508 at d 64, 0.3401 ->
# 0.2396 at d 256, 1 x 32k 1.2x; it costs 1 x 8k at d 128 0.0257 -> 0.0294. At two sequences 64 lost (H200
# h200-tq4-one-sequence-d128.md: 2 x 8k 0.0270 -> 0.0315 ms).
MAX_SPLITS = 32
MAX_SPLITS_ONE_SEQUENCE = 64
MIN_SPLIT_TOKENS = 256
# One sequence splits down to 128 tokens (4 tiles a warp): its short splits finish sooner, and their programs fill
# the GPU. H100 (h100-tq4-one-sequence-split-floor-d{64,128,256}.md), 1 x 8k: d 128 group 4 0.0183 -> 0.0155 ms,
# group 16 0.0264 -> 0.0226, d 64 group 8 0.0142 -> 0.0125, d 256 group 4 0.0321 -> 0.0270; 64 tokens at 128 splits
# lost to it (0.0162 at d 128 group 4); 1 x 32k unchanged; at two sequences 128 tokens gained nothing (2 x 8k
# 0.0190 -> 0.0191).
MIN_SPLIT_TOKENS_ONE_SEQUENCE = 128
# One sequence over few KV heads: splits for at least 512 programs (up to 256 splits); 64 splits left 4 KV heads 256
# one-warp programs. H100 (h100-tq4-one-sequence-splits-by-kv-heads-d{64,128}.md): 16 q / 4 KV 1 x 100k 0.0539 ->
# 0.0369 ms (128 splits), 8 / 2 1 x 128k 0.0641 -> 0.0259 (256), d 64 9 / 3 1 x 128k 0.0429 -> 0.0257 (256), 1 x 8k
# within 3%; 8 KV heads keep 64 (128 splits: 1 x 128k 0.0705 -> 0.0686, but 1 x 8k 0.0155 -> 0.0181).
MIN_PROGRAMS_ONE_SEQUENCE = 512
MAX_SPLITS_FEW_KV_HEADS = 256
# tq4 at head_dim 256, 16 q / 8 KV heads, H100 (h100-tq4-d256-split-count.md): up to 16 splits of two or more
# sequences, not 32: 16 x 2k 0.1448 -> 0.0946 ms, 2 x 8k 0.1024 -> 0.0770, 8 x 32k 0.3546 -> 0.2829; splits left
# empty there cost more than they save (the 512-token floor: 2 x 8k 0.1313). One sequence keeps 64: 1 x 32k 0.1490 ms
# (16: 0.1784), 1 x 8k 0.0907 (16: 0.0640). Aiming at 4 programs an SM (rounded up) rather than 24 takes 16 x 2k to
# 8 splits: H200 (h200-tq4-d256-split-count.md) 0.0919 -> 0.0825 ms (H100 0.0946 -> 0.0847), the best of 2-16 at
# every measured shape within 1% (8 x 32k and 2 x 8k keep 16; 64 x 8k 2, 0.4596 vs 8 splits 0.4545).
MAX_SPLITS_HEAD_DIM_256 = 16
PROGRAMS_PER_SM_HEAD_DIM_256 = 4
# Query tokens a sequence the decode kernel runs as that many decodes (speculative verification: 1 + drafted tokens,
# twice the drafts under parallel drafting); each reads its context once, so longer queries take the general kernel.
MAX_DECODE_QUERY_LEN = 16


def num_sms(device: torch.device | None = None) -> int:
    """Streaming multiprocessors of the CUDA device (the current one by default); NUM_SMS_FALLBACK without CUDA."""
    if not torch.cuda.is_available():
        return NUM_SMS_FALLBACK
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    return torch.cuda.get_device_properties(index).multi_processor_count


def per_warp_decode(preset: Preset) -> bool:
    """Decode runs the decode kernel except over 5-bit keys: their table gathers made k5v4 1.8x slower there than in
    the general kernel."""
    return preset.k_bits != 5


@dataclass(frozen=True)
class AttentionLaunch:
    """How a layout's decode launches: what was measured to pay on the H200."""

    num_warps: int
    num_stages: int  # Triton's pipeline depth: 5 gives each of the loop's loads two buffers, 2..4 one
    max_registers: int  # per thread; 0: the compiler's choice
    programs_per_sm: int  # the split count's target (split_count)
    max_splits_one_sequence: int = MAX_SPLITS  # the split cap when the batch is one sequence
    max_splits: int = MAX_SPLITS  # the split cap otherwise


GENERAL_LAUNCH = AttentionLaunch(4, 3, 0, 1)  # the general kernel outside decode: one split


def decode_launch(preset: Preset, head_dim: int) -> AttentionLaunch:
    """tq4 at head_dim <= 128: one-warp programs, loads two tiles ahead, 168 registers (12 programs fit an SM) and
    ~6 programs per SM, one wave: 1.07x over one tile ahead and 24 programs per SM at 16 / 4 heads, 64 x 8k and
    32 x 32k, 1.09x at head_dim 64. The narrower presets: one tile ahead (two buffers cost them 5%), 24 programs per
    SM, 168 registers at head_dim 65..128 (tq3 1.05x, tq2 1.09x over uncapped); tq4 at head_dim 256 uncapped, 4
    programs an SM and at most 16 splits of two or more sequences. The general kernel (5-bit keys): four warps, 2
    programs per SM, no register cap (every cap tried lost)."""
    if not per_warp_decode(preset):
        return AttentionLaunch(4, 3, 0, 2)
    width = next_pow2(head_dim)
    if preset.k_bits == 4 and preset.v_bits == 4:
        if width <= 128:
            return AttentionLaunch(1, 5, 168, 6, MAX_SPLITS_ONE_SEQUENCE)
        return AttentionLaunch(1, 3, 0, PROGRAMS_PER_SM_HEAD_DIM_256, MAX_SPLITS_ONE_SEQUENCE, MAX_SPLITS_HEAD_DIM_256)
    return AttentionLaunch(1, 3, 168 if width == 128 else 0, 24, MAX_SPLITS_ONE_SEQUENCE)


def split_count(num_seqs: int, num_kv_heads: int, sms: int, programs_per_sm: int,
                max_splits: int = MAX_SPLITS) -> int:
    """Splits so that sequences x KV heads x splits give every SM about programs_per_sm programs, rounded up to a
    power of two, at most max_splits. Depends on the batch shape only, so a captured CUDA graph replays correctly
    (the decode kernel leaves the splits past a short context empty: MIN_SPLIT_TOKENS)."""
    programs = max(1, num_seqs * num_kv_heads)
    return max(1, min(max_splits, next_pow2(math.ceil(programs_per_sm * sms / programs))))


def decode_num_splits(num_seqs: int, layout: CacheLayout, sms: int | None = None) -> int:
    """The split count of a decode launch of num_seqs sequences over this layout (1 without decodes)."""
    if not num_seqs:
        return 1
    launch = decode_launch(layout.preset, layout.head_dim)
    cap = launch.max_splits_one_sequence if num_seqs == 1 else launch.max_splits
    splits = split_count(num_seqs, layout.num_kv_heads, sms or num_sms(), launch.programs_per_sm, cap)
    if num_seqs == 1 and per_warp_decode(layout.preset):
        few_heads = next_pow2(math.ceil(MIN_PROGRAMS_ONE_SEQUENCE / layout.num_kv_heads))
        splits = max(splits, min(MAX_SPLITS_FEW_KV_HEADS, few_heads))
    return splits


def decode_min_split_tokens(num_seqs: int) -> int:
    """The decode kernel's least tokens a split in a launch of num_seqs sequences."""
    return MIN_SPLIT_TOKENS_ONE_SEQUENCE if num_seqs == 1 else MIN_SPLIT_TOKENS


def decode_head_split(num_seqs: int, preset: Preset, head_dim: int, group: int) -> int:
    """Decode programs a KV head's query heads are dealt to (8 or more each): 2 for one sequence of tq4 at head_dim
    256 and groups over 8, whose 16-row tiles make each program twice as long. H100
    (h100-tq4-head-split-group16-d256.md), group 16: 1 x 8k 0.0538 -> 0.0414 ms, 1 x 32k 0.1006 -> 0.0793; at 8 x 32k
    it lost (0.4246 -> 0.4647), and at head_dim <= 128 it lost but at 1 x 8k (h100-tq4-head-split-group16-d64-d128.md:
    d 128 1 x 32k 0.0388 -> 0.0412)."""
    tq4 = preset.k_bits == 4 and preset.v_bits == 4
    return 2 if num_seqs == 1 and tq4 and head_dim > 128 and group > 8 else 1


def decode_merge_rows(rows: int) -> int | None:
    """Rows a merge program of a decode launch takes (ops.rotation.merge_and_unrotate); None: its tile's rows.
    Up to SPREAD_ROWS rows, SPREAD: two launches over many SMs instead of one over a few programs walking R and the
    partials one K step at a time."""
    return SPREAD if rows <= SPREAD_ROWS else None


def attention_workspace_shape(num_tokens: int, num_q_heads: int, head_dim: int, num_splits: int) -> tuple[int]:
    """fp32 elements of scratch: each split's partials (accumulator, row max, row sum) per output row."""
    return (num_tokens * num_q_heads * num_splits * (head_dim + 2),)
