"""Compile, before serving, the kernels that the first requests would otherwise compile.

CUDA-graph capture compiles the decode kernels of the captured batch sizes, but not what prefill
runs: the store's large tiles, the context expansion of the dense prefill path, the general attention
kernel (short prefills, speculative verification) and the query rotation's wide tiles; nor, without
graphs, the decode kernel of each split count. Each was a Triton JIT compile inside a request: 3 s in
the first prefill step of a fresh engine, 1.4 s in the first step whose prompt chunk had a cached
context. A launch of each on a scratch cache compiles the same binaries:
their compile keys hold the layout, dtypes and launch constants, while batch sizes and the block
table's width are not specialized. The layout holds the preset: a model with per-layer presets warms up once per
preset its layers use (vllm/impl.py, each layer with its own layout); its bf16 layers run vLLM's FlashAttention,
compiled ahead of time.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import triton

from ..core.calibration import KeyCalibration
from ..core.layout import CacheLayout
from .attention import paged_attention
from .attention.launch import (
    decode_head_split,
    decode_merge_rows,
    decode_min_split_tokens,
    decode_num_splits,
    num_sms,
)
from .dequant import dequantize_pages
from .rotation.rotation import LARGE_ROWS, launch_shape
from .store.store import STORE_LARGE_BATCH, store_block_tokens, store_kv


def warm_up(
    layout: CacheLayout, dtype: torch.dtype, num_q_heads: int, device: torch.device, *,
    sliding_window: int | None = None, softcap: float | None = None, key_calibration: KeyCalibration | None = None,
    dense_prefill: bool = True, decode_batches: Iterable[int] = (), decode_query_len: int = 1,
) -> None:
    """Run every prefill-side launch once for this layer shape, with vLLM's metadata dtypes (int32 indices,
    int64 slots), and one decode launch per distinct binary that decode batches of decode_batches sequences take
    (their split count and their merge's tiling), of one query token a sequence and of decode_query_len (speculative
    verification). dense_prefill: whether long prefills expand the context (FlashAttention present)."""
    d, block = layout.head_dim, layout.block_size
    # One sequence; the general kernel runs it as a short prefill and as one of over LARGE_ROWS query rows.
    lengths = (block, triton.cdiv(LARGE_ROWS + 1, num_q_heads))
    n = max(lengths)
    blocks = triton.cdiv(n, block)
    cache = torch.zeros(layout.cache_shape(blocks), dtype=torch.uint8, device=device)
    key = torch.randn(n, layout.num_kv_heads, d, dtype=dtype, device=device)
    value = torch.randn_like(key)
    slots = torch.arange(n, dtype=torch.int64, device=device)
    queries = torch.randn(n, num_q_heads, d, dtype=dtype, device=device)
    # A step stores its keys with its queries' rotation in one launch, or without (dense or batch-invariant prefill).
    for block_t in sorted({store_block_tokens(1, d), store_block_tokens(STORE_LARGE_BATCH, d)}):
        for query in (None, queries):
            store_kv(key, value, cache, slots, layout, key_calibration, block_t=block_t, query=query,
                     query_scale=d**-0.5)
    block_table = torch.arange(blocks, dtype=torch.int32, device=device)[None]

    def sequence(length: int) -> tuple[torch.Tensor, torch.Tensor]:  # its seq_lens and query / context starts
        return (torch.tensor([length], dtype=torch.int32, device=device),
                torch.tensor([0, length], dtype=torch.int32, device=device))

    for length in lengths:
        seq_lens, starts = sequence(length)
        query = torch.randn(length, num_q_heads, d, dtype=dtype, device=device)
        paged_attention(query, cache, layout, block_table, starts, seq_lens, max_query_len=length, scale=d**-0.5,
                        out=torch.empty_like(query), sliding_window=sliding_window, softcap=softcap,
                        key_calibration=key_calibration)
    seq_lens, starts = sequence(n)
    if dense_prefill:  # one binary whatever the lengths
        dequantize_pages(cache, layout, block_table, seq_lens, starts, n, n, dtype, key_calibration)
    sms = num_sms(device)
    binaries = {}  # (query length, split count and floor, head split, merge rows, merge tile) -> the fewest
    # sequences launching it
    group = num_q_heads // layout.num_kv_heads
    for q_len in sorted({1, decode_query_len}):
        for seqs in sorted(set(decode_batches)):
            rows = seqs * q_len * num_q_heads
            binaries.setdefault((q_len, decode_num_splits(seqs, layout, sms), decode_min_split_tokens(seqs),
                                 decode_head_split(seqs, layout.preset, d, group), decode_merge_rows(rows),
                                 launch_shape(rows, d)), seqs)
    for (q_len, *_), seqs in binaries.items():  # every sequence reads the one scratch context
        query = torch.randn(seqs * q_len, num_q_heads, d, dtype=dtype, device=device)
        paged_attention(query, cache, layout, block_table.repeat(seqs, 1),
                        torch.arange(0, seqs * q_len + 1, q_len, dtype=torch.int32, device=device),
                        seq_lens.repeat(seqs), max_query_len=q_len, scale=d**-0.5, out=torch.empty_like(query),
                        sliding_window=sliding_window, softcap=softcap, key_calibration=key_calibration, decode=True)
