"""Plain PyTorch references for the kernels: paged store, paged attention, rotation in and out.

Slow and simple on purpose: every kernel in turboquant_vllm.kernels is tested against these.
"""

from __future__ import annotations

import math

import torch

from .calibration import KeyCalibration
from .layout import CacheLayout
from .presets import NORM_BYTES
from .quantizer import Quantizer


def quantizers(layout: CacheLayout) -> tuple[Quantizer, Quantizer]:
    return Quantizer(layout.preset.k_bits, layout.head_dim), Quantizer(layout.preset.v_bits, layout.head_dim)


def _norm_bytes(norms: torch.Tensor) -> torch.Tensor:
    return norms.contiguous().view(torch.uint8).reshape(*norms.shape, NORM_BYTES)


def store_kv_reference(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, layout: CacheLayout,
    key_calibration: KeyCalibration | None = None,
) -> None:
    """Quantize key/value (tokens, kv_heads, head_dim) and write each token into its slot (-1: skip).

    With a key calibration the cache holds the calibrated keys (key - mean) / scale."""
    kq, vq = quantizers(layout)
    if key_calibration is not None:
        key = key_calibration.keys(key)
    k_codes, k_norms = kq.quantize(key)
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


def read_kv_reference(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int, layout: CacheLayout, rotated: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize the first num_tokens of the blocks block_ids -> K, V (num_tokens, kv_heads, head_dim) fp32."""
    kq, vq = quantizers(layout)
    bs, h = layout.block_size, layout.num_kv_heads
    pages = kv_cache[block_ids.long()]  # (blocks, kv_heads, head_page_bytes)

    def part(offset: int, record: int) -> torch.Tensor:
        raw = pages[:, :, offset : offset + bs * record].reshape(-1, h, bs, record)
        return raw.transpose(1, 2).reshape(-1, h, record)[:num_tokens]

    def norms(offset: int) -> torch.Tensor:
        return part(offset, NORM_BYTES).contiguous().view(torch.float32).squeeze(-1)

    k_codes, v_codes = part(0, layout.key_code_bytes), part(layout.value_code_offset, layout.value_code_bytes)
    if rotated:
        k = kq.dequantize_rotated(k_codes, norms(layout.key_norm_offset))
        v = vq.dequantize_rotated(v_codes, norms(layout.value_norm_offset))
    else:
        k = kq.dequantize(k_codes, norms(layout.key_norm_offset))
        v = vq.dequantize(v_codes, norms(layout.value_norm_offset))
    return k, v


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
    with, queries are scaled to match the calibrated keys (see core.calibration).
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
        k, v = read_kv_reference(kv_cache, blocks, seq_len, layout)
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


def rotate_queries_reference(
    query: torch.Tensor, rotation: torch.Tensor, scale: float, key_calibration: KeyCalibration | None = None
) -> torch.Tensor:
    """Queries (tokens, q_heads, d) into the rotated basis with the key scale and `scale` folded in, fp32."""
    q = query.float() if key_calibration is None else key_calibration.queries(query)
    return (q @ rotation.T) * scale


def merge_and_unrotate_reference(part_acc: torch.Tensor, part_ml: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Merge split-KV partials and leave the rotated basis, fp32: part_acc (rows, splits, d) unnormalized
    outputs, part_ml (rows, 2, splits) log2-domain row maxima and row sums; rows without keys give 0."""
    m, l_part = part_ml[:, 0], part_ml[:, 1]
    w = torch.exp2(m - m.max(dim=1, keepdim=True).values).nan_to_num(0.0)  # all -inf: no key seen
    total = (w * l_part).sum(dim=1, keepdim=True)
    o = (part_acc * w.unsqueeze(-1)).sum(dim=1) / torch.where(total == 0, 1.0, total)
    return o @ rotation
