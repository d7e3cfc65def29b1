"""Plain PyTorch reference of paged attention over the compressed pages (fp32, one sequence at a time).

ops.attention.paged_attention is tested against it, for decode, prefill, chunked prefill, sliding window, soft-cap
and key calibration.
"""

from __future__ import annotations

import math

import torch

from ...core.calibration import KeyCalibration
from ...core.layout import CacheLayout
from ..dequant.naive import read_kv_reference


def paged_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: CacheLayout,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    key_calibration: KeyCalibration | None = None,
) -> torch.Tensor:
    """Causal attention of query (tokens, q_heads, head_dim) over the compressed pages, fp32.

    The query tokens of sequence i are the last ones of its seq_lens[i] tokens (vLLM's varlen
    convention); the cache already holds all of them. With the key calibration the cache was stored
    with, queries are scaled to match the calibrated keys, read back as centered ones (see core.calibration).
    """
    if key_calibration is not None:
        query = key_calibration.queries(query)
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    group = query.shape[1] // layout.num_kv_heads
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q = query[starts[i] : starts[i + 1]].float()
        n_q = q.shape[0]
        if n_q == 0:
            continue
        blocks = block_table[i, : math.ceil(seq_len / layout.block_size)]
        k, v = read_kv_reference(kv_cache, blocks, seq_len, layout, key_calibration=key_calibration)
        k = k.repeat_interleave(group, dim=1)  # (seq_len, q_heads, d)
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        q_pos = torch.arange(seq_len - n_q, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        allowed = k_pos <= q_pos
        if sliding_window:
            allowed &= k_pos > q_pos - sliding_window
        s = s.masked_fill(~allowed, float("-inf"))
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)
    return out
