"""Dequantize the pages of some sequences into contiguous K/V in the model's basis.

Reference: naive.read_kv_reference, keys (read back as centered ones) times the key calibration's scale.

Long prefills are compute-bound: there it pays to expand the compressed context once per step and
hand it to a dense attention kernel (the vLLM backend uses FlashAttention), instead of re-decoding
the codes for every tile of query tokens. Leaving the rotated basis here, on the context's
KV heads' rows, spares rotating every query head in and every output out (2 x group x the rows,
for a prefill without a cached prefix), so attention takes the model's queries and writes its
output as they are. With the key calibration, keys come back as centered ones times its scale: q . K is then
exactly the calibrated score (q * scale) . (k - mean) / scale (see core.calibration).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.calibration import KeyCalibration
from ...core.layout import CacheLayout
from ..constants import kernel_constants
from ..utils import (
    INTERPRETED,
    check_cache,
    check_dtype,
    check_index,
    load_halves,
    locate_tokens,
    mma,
    next_pow2,
    page_constants,
    pair_index,
    round_to,
)


@triton.jit
def _expand(cache_ptr, page, off, n_ok, lut_ptr, rot_ptr, mean_ptr, scale_ptr, out_ptr, row, head, stride_ot,
            stride_oh,
            SCALED: tl.constexpr, ASM: tl.constexpr, BITS: tl.constexpr, CODE_OFF: tl.constexpr,
            CODE_BYTES: tl.constexpr, NORM_OFF: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, INTERPRET: tl.constexpr):
    """out[row] = (norm * value[code]) @ R for BLOCK_N records; SCALED (calibrated keys): times the key scale, and
    a negative norm (an uncentered key, core.calibration) taken by magnitude, minus the key mean."""
    even, odd = load_halves(cache_ptr, (page + CODE_OFF + off * CODE_BYTES)[:, None], n_ok[:, None], lut_ptr,
                            ASM, BITS, HEAD_DIM, D_PAD // 2)
    norm = tl.load((cache_ptr + page + NORM_OFF + off * 4).to(tl.pointer_type(tl.float32)), mask=n_ok, other=0.0)
    if SCALED:
        uncentered = (norm < 0)[:, None]
        norm = tl.abs(norm)
    i = pair_index(tl.arange(0, D_PAD // 2), BITS, HEAD_DIM)  # the pair of coordinates even / odd hold
    for j0 in tl.static_range(0, D_PAD, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        ok = (2 * i[:, None] < HEAD_DIM) & (j[None, :] < HEAD_DIM)  # padded coordinates decode to code 0's value
        acc = tl.zeros((BLOCK_N, BLOCK_J), tl.float32)
        for part in tl.static_range(2):  # R's fp16 high part, then the rest: exact fp16 products, fp32 sums
            r = rot_ptr + part * HEAD_DIM * HEAD_DIM + j[None, :]
            acc = mma(even, tl.load(r + (2 * i)[:, None] * HEAD_DIM, mask=ok, other=0.0), acc, INTERPRET)
            acc = mma(odd, tl.load(r + (2 * i + 1)[:, None] * HEAD_DIM, mask=ok, other=0.0), acc, INTERPRET)
        x = acc * norm[:, None]
        if SCALED:
            x *= tl.load(scale_ptr + head * HEAD_DIM + j, mask=j < HEAD_DIM, other=0.0)[None, :]
            x -= tl.where(uncentered, tl.load(mean_ptr + head * HEAD_DIM + j, mask=j < HEAD_DIM, other=0.0)[None, :],
                          0.0)
        tl.store(out_ptr + row[:, None] * stride_ot + head * stride_oh + j[None, :],
                 round_to(x, out_ptr.dtype.element_ty, INTERPRET), mask=n_ok[:, None] & (j[None, :] < HEAD_DIM))


# The block table's width, and where a mixed batch's prefill rows start: one compile for all (ops.warmup)
@triton.jit(do_not_specialize=["stride_bt"],
            do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr", "cu_k_ptr"])
def _dequant_kernel(
    cache_ptr, block_table_ptr, seq_lens_ptr, cu_k_ptr, k_lut_ptr, v_lut_ptr, rot_ptr, key_mean_ptr, key_scale_ptr,
    k_out_ptr, v_out_ptr, stride_bt, stride_cblock, stride_chead, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_CODE_BYTES: tl.constexpr,
    V_CODE_BYTES: tl.constexpr, K_NORM_OFF: tl.constexpr, V_CODE_OFF: tl.constexpr, V_NORM_OFF: tl.constexpr,
    CALIBRATED: tl.constexpr, K_ASM: tl.constexpr, V_ASM: tl.constexpr, INTERPRET: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if tile * BLOCK_N >= seq_len:
        return
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < seq_len
    page, off = locate_tokens(block_table_ptr + seq * stride_bt, n, n_ok, stride_cblock, head * stride_chead,
                              BLOCK_SIZE)
    row = tl.load(cu_k_ptr + seq) + n
    _expand(cache_ptr, page, off, n_ok, k_lut_ptr, rot_ptr, key_mean_ptr, key_scale_ptr, k_out_ptr, row, head,
            stride_ot, stride_oh, CALIBRATED, K_ASM, K_BITS, 0, K_CODE_BYTES, K_NORM_OFF, HEAD_DIM, D_PAD, BLOCK_N,
            BLOCK_J, INTERPRET)
    _expand(cache_ptr, page, off, n_ok, v_lut_ptr, rot_ptr, key_mean_ptr, key_scale_ptr, v_out_ptr, row, head,
            stride_ot, stride_oh, False, V_ASM, V_BITS, V_CODE_OFF, V_CODE_BYTES, V_NORM_OFF, HEAD_DIM, D_PAD,
            BLOCK_N, BLOCK_J, INTERPRET)


def dequantize_pages(
    kv_cache: torch.Tensor,
    layout: CacheLayout,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    total_tokens: int,
    max_seq_len: int,
    dtype: torch.dtype,
    key_calibration: KeyCalibration | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V (total_tokens, kv_heads, head_dim) of `dtype` in the model's basis, sequence i at rows cu_seqlens_k[i]:.
    With the key calibration the cache was stored with, K is scale * the cached keys read back as centered ones
    (k - mean) / scale (core.calibration.KeyCalibration.dequantize), ~ k - mean: q . K then equals the calibrated
    score (q * scale) . (k - mean) / scale of every key, centered or not. validate=False: the caller has checked
    kv_cache against layout already (the vLLM backend, once per forward)."""
    if validate:
        check_cache(kv_cache, layout)
    check_dtype("dtype", torch.empty(0, dtype=dtype))
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens), ("cu_seqlens_k", cu_seqlens_k)):
        check_index(name, t, kv_cache)
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_k.shape[0] != num_seqs + 1:
        raise ValueError("cu_seqlens_k needs num_seqs + 1 entries")
    shape = (total_tokens, layout.num_kv_heads, layout.head_dim)
    k = torch.empty(shape, dtype=dtype, device=kv_cache.device)
    v = torch.empty_like(k)
    if total_tokens == 0 or num_seqs == 0:
        return k, v
    c = kernel_constants(layout, kv_cache.device)
    # any valid pointers without a calibration
    key_mean, key_scale = (key_calibration.mean, key_calibration.scale) if key_calibration else (c.rotation, c.rotation)
    block_n, d_pad = 64, next_pow2(layout.head_dim)
    grid = (triton.cdiv(max_seq_len, block_n), num_seqs, layout.num_kv_heads)
    _dequant_kernel[grid](
        kv_cache, block_table, seq_lens, cu_seqlens_k, c.key_values[torch.float16], c.value_values[torch.float16],
        c.rotation_fp16, key_mean, key_scale, k, v,
        block_table.stride(0), kv_cache.stride(0), kv_cache.stride(1), k.stride(0), k.stride(1),
        BLOCK_N=block_n, BLOCK_J=min(64, d_pad), **page_constants(layout),
        CALIBRATED=key_calibration is not None, K_ASM="" if INTERPRETED else c.key_lookup_asm,
        V_ASM="" if INTERPRETED else c.value_lookup_asm, INTERPRET=INTERPRETED,
        num_warps=4,
    )
    return k, v
