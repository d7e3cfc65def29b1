"""Paged attention straight over the compressed cache (decode, prefill, chunked prefill).

Reference: turboquant_vllm.core.reference.paged_attention_reference.

Attention runs in the rotated basis: q.k = ||k|| (R q).value[code_k] and
sum_j p_j v_j = R^T sum_j p_j ||v_j|| value[code_v,j]. kernels.rotation rotates the queries once
before and the outputs once after (merging the splits there); the inner loop is load codes ->
unpack -> table lookup -> MMA, with the norms applied to the scores (keys) and to the
exponents (values: log2 of the norm), never per element. 4-bit keys decode to int8 (one byte permute per 4 codes,
the codebook lies on an int8 grid: core.codebook.codebook) and meet the queries' int8 hi / lo parts
in exact integer MMAs; values decode to fp16.

One program handles one tile of query tokens of one sequence, all query heads of one KV head
(so each compressed byte is read once per KV head) and one split of the context. With more
than one split, each writes its partials to the workspace. Decode has its own kernel, _decode_kernel, in which
each warp keeps its own softmax: for tq4 1.18-1.25x faster than the general kernel's decode
(benchmarks/results/decode_kernel_session7.log), for the 2- and 3-bit presets 1.04-1.25x
(decode_kernel_session9.log), and launched one warp per program 1.13-1.45x faster again
(decode_kernel_session12.log); 5-bit keys stay in the general kernel (per_warp_decode).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..core.calibration import KeyCalibration
from ..core.layout import CacheLayout
from ..core.presets import Preset
from .common import (INTERPRETED, check_dtype, check_index, load_halves, load_int8_quads, locate_tokens, mma,
                     next_pow2, page_constants, pair_index)
from .constants import kernel_constants
from .rotation import merge_and_unrotate, rotate_queries
from .store import check_cache, check_calibration

NUM_SMS_DEFAULT = 132


@triton.jit
def _int_mma(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b of int8 operands: int32 and exact on the GPU; fp32 when interpreted (see common.mma)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc.to(tl.float32))
    return tl.dot(a, b, acc, out_dtype=tl.int32)


@triton.jit
def _int8_query(q_row, row_ok, k_step, HEAD_DIM: tl.constexpr, DH: tl.constexpr, SCORE_UNIT: tl.constexpr):
    """The query rows at q_row ((rows, 1) pointers) as quads in the order of the int8 key tiles
    (kernels.common.load_int8_quads: coordinates 8i + 0..3, then 8i + 4..7), each q = q_step * (hi + lo / 254), hi
    and lo int8 in [-127, 127] (~15 bits), so q.k is two exact int8 MMAs over one decoded key tile. Scores accumulate
    254 hi + lo as int32; q_gain turns them into SCORE_UNIT units. A key code t stands for (t + 1/2) * k_step: the
    halves add q_half."""
    quad = 8 * (tl.arange(0, DH) // 4) + tl.arange(0, DH) % 4
    quad_ok = row_ok[:, None] & (quad[None, :] < HEAD_DIM)
    qa = tl.load(q_row + quad[None, :], mask=quad_ok, other=0.0).to(tl.float32)
    qb = tl.load(q_row + 4 + quad[None, :], mask=quad_ok, other=0.0).to(tl.float32)
    q_max = tl.maximum(tl.max(tl.abs(qa), axis=1), tl.max(tl.abs(qb), axis=1))
    q_step = tl.where(q_max > 0, q_max / 127.0, 1.0)
    qa = qa / q_step[:, None]
    qb = qb / q_step[:, None]
    qa_hi = tl.floor(qa + 0.5)
    qb_hi = tl.floor(qb + 0.5)
    qa_lo = tl.floor((qa - qa_hi) * 254.0 + 0.5)
    qb_lo = tl.floor((qb - qb_hi) * 254.0 + 0.5)
    q_gain = q_step * (k_step / 254.0) * SCORE_UNIT
    q_half = 0.5 * (tl.sum(254.0 * qa_hi + qa_lo, axis=1) + tl.sum(254.0 * qb_hi + qb_lo, axis=1)) * q_gain
    return qa_hi.to(tl.int8), qb_hi.to(tl.int8), qa_lo.to(tl.int8), qb_lo.to(tl.int8), q_gain, q_half


@triton.jit
def _query_halves(q_row, row_ok, BITS: tl.constexpr, HEAD_DIM: tl.constexpr, DH: tl.constexpr):
    """The query rows at q_row ((rows, 1) pointers) as (even, odd) coordinates in the order of the key tiles' pairs
    (kernels.common.pair_index), (rows, DH) each."""
    col = 2 * pair_index(tl.arange(0, DH), BITS, HEAD_DIM)
    ok = row_ok[:, None] & (col[None, :] < HEAD_DIM)
    q_even = tl.load(q_row + col[None, :], mask=ok, other=0.0)
    q_odd = tl.load(q_row + col[None, :] + 1, mask=ok, other=0.0)
    return q_even, q_odd


@triton.jit
def _value_norm_terms(v_norm, UPCAST: tl.constexpr):
    """log2 ||v|| and 1 / ||v||, the norm floored at 2^-60.

    Value norms join the exponent: p_j ||v_j|| = exp2(s_j + log2 ||v_j|| - m) <= 1 fits the fp16 operand with
    no reduction over the tile's norms (each one costs the block a barrier); l divides the norms out again.
    The floor keeps a zero norm's weight in l: fp32 holds p down to 2^-126, so norms up to ~2^50 are safe."""
    v_norm = tl.maximum(v_norm, 8.673617379884035e-19)  # 2^-60
    if UPCAST:
        log_norm = tl.log2(v_norm)
        inv_norm = 1.0 / v_norm
    else:  # the hardware's approximations (~2^-22 relative): the libdevice log2 is a branchy routine
        log_norm, inv_norm = tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $2; rcp.approx.ftz.f32 $1, $2;", "=r,=r,r",
                                                       [v_norm], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    return log_norm, inv_norm


# num_seqs changes with every batch, stride_bt with max_model_len, and a mixed batch's prefill rows start
# mid-tensor (any alignment): none of them recompiles (kernels.warmup)
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"],
            do_not_specialize_on_alignment=["block_table_ptr", "qsl_ptr", "seq_lens_ptr"])
def _attention_kernel(
    q_ptr, cache_ptr, block_table_ptr, qsl_ptr, seq_lens_ptr, k_lut_ptr, v_lut_ptr,
    part_acc_ptr, part_ml_ptr,
    num_seqs, stride_qt, stride_qh, stride_bt, stride_cblock, stride_chead, sliding_window, softcap, k_step,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DECODE_ONLY: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_CODE_BYTES: tl.constexpr, V_CODE_BYTES: tl.constexpr,
    K_NORM_OFF: tl.constexpr, V_CODE_OFF: tl.constexpr, V_NORM_OFF: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
    K_ASM: tl.constexpr, V_ASM: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE_ONLY:
        seq = pid
        tile = 0
    else:
        # Tiles of sequence s are numbered from qsl[s] // BLOCK_Q + s: find s by binary search.
        lo = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= pid:
                lo = mid + 1
            else:
                hi = mid
        seq = lo - 1
        tile = pid - (tl.load(qsl_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    LOG2E: tl.constexpr = 1.4426950408889634
    # Scores come out in log2 units (what exp2 wants) unless a soft-cap needs them in natural ones first.
    SCORE_UNIT: tl.constexpr = 1.0 if USE_SOFTCAP else LOG2E
    rows = tl.arange(0, BLOCK_M)
    q_idx = tile * BLOCK_Q + rows // G_PAD  # query token within the sequence
    g = rows % G_PAD
    row_ok = (rows < BLOCK_Q * G_PAD) & (g < GROUP) & (q_idx < q_len)
    head = kv_head * GROUP + g
    token = q_start + q_idx
    # Work on even and odd coordinates separately: that is how codes share bytes (tiles hold common.pair_index).
    DH: tl.constexpr = D_PAD // 2
    q_row = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
    if K_BITS == 4:  # 4-bit keys are int8 (kernels.common.load_int8_quads), so are the queries
        qa_hi, qb_hi, qa_lo, qb_lo, q_gain, q_half = _int8_query(q_row, row_ok, k_step, HEAD_DIM, DH, SCORE_UNIT)
    else:
        q_even, q_odd = _query_halves(q_row, row_ok, K_BITS, HEAD_DIM, DH)
    q_pos = ctx_len + q_idx  # absolute position of each row's query token

    last_q = tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_hi = ctx_len + last_q + 1
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(ctx_len + tile * BLOCK_Q - sliding_window + 1, 0)
        kv_lo = (kv_lo // BLOCK_N) * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(kv_hi - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = kv_lo + split * per_split
    end = tl.minimum(start + per_split, kv_hi)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc_even = tl.zeros((BLOCK_M, DH), tl.float32)
    acc_odd = tl.zeros((BLOCK_M, DH), tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + cols
        n_ok = n < end
        page, off = locate_tokens(block_table_ptr + seq * stride_bt, n, n_ok, stride_cblock, kv_head * stride_chead,
                                  BLOCK_SIZE)
        k_norm = tl.load((cache_ptr + page + K_NORM_OFF + off * 4).to(tl.pointer_type(tl.float32)), mask=n_ok,
                         other=0.0)
        if K_BITS == 4:
            ka, kb = load_int8_quads(cache_ptr, (page + off * K_CODE_BYTES)[:, None], n_ok[:, None], k_lut_ptr, K_ASM,
                                     HEAD_DIM, D_PAD)
            ka = tl.trans(ka)
            kb = tl.trans(kb)
            s = _int_mma(qb_hi, kb, _int_mma(qa_hi, ka, tl.zeros((BLOCK_M, BLOCK_N), tl.int32), UPCAST), UPCAST)
            s = _int_mma(qb_lo, kb, _int_mma(qa_lo, ka, s * 254, UPCAST), UPCAST)
            s = (s.to(tl.float32) * q_gain[:, None] + q_half[:, None]) * k_norm[None, :]
        else:
            k_even, k_odd = load_halves(cache_ptr, (page + off * K_CODE_BYTES)[:, None], n_ok[:, None], k_lut_ptr,
                                        K_ASM, K_BITS, HEAD_DIM, DH)
            s = mma(q_even, tl.trans(k_even), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), UPCAST)
            s = mma(q_odd, tl.trans(k_odd), s, UPCAST) * (k_norm * SCORE_UNIT)[None, :]
        if USE_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0) * LOG2E  # softcap * tanh(s / softcap)
        if DECODE_ONLY:  # the one query is the last token: n < end is the causal mask
            allowed = n_ok[None, :]
        else:
            allowed = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed &= n[None, :] > q_pos[:, None] - sliding_window
        v_norm = tl.load((cache_ptr + page + V_NORM_OFF + off * 4).to(tl.pointer_type(tl.float32)), mask=n_ok,
                         other=1.0)
        log_norm, inv_norm = _value_norm_terms(v_norm, UPCAST)
        s = tl.where(allowed, s + log_norm[None, :], float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p * inv_norm[None, :], axis=1)
        v_even, v_odd = load_halves(cache_ptr, (page + V_CODE_OFF + off * V_CODE_BYTES)[:, None], n_ok[:, None],
                                     v_lut_ptr, V_ASM, V_BITS, HEAD_DIM, DH)
        pv = p.to(tl.float16)
        acc_even = mma(pv, v_even, acc_even * alpha[:, None], UPCAST)
        acc_odd = mma(pv, v_odd, acc_odd * alpha[:, None], UPCAST)
        m_i = m_new

    # Partials of this split; kernels.rotation merges the splits and leaves the rotated basis.
    out_rows = token[:, None] * NUM_Q_HEADS + head[:, None]
    even = 2 * pair_index(tl.arange(0, DH), V_BITS, HEAD_DIM)
    d_ok = row_ok[:, None] & (even[None, :] < HEAD_DIM)
    part = part_acc_ptr + (out_rows * NUM_SPLITS + split) * HEAD_DIM + even[None, :]
    tl.store(part, acc_even, mask=d_ok)
    tl.store(part + 1, acc_odd, mask=d_ok)
    ml = part_ml_ptr + (token * NUM_Q_HEADS + head) * (2 * NUM_SPLITS) + split
    tl.store(ml, m_i, mask=row_ok)
    tl.store(ml + NUM_SPLITS, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["stride_bt"])  # the block table's width: one compile for all (kernels.warmup)
def _decode_kernel(
    q_ptr, cache_ptr, block_table_ptr, qsl_ptr, seq_lens_ptr, k_lut_ptr, v_lut_ptr, part_acc_ptr, part_ml_ptr,
    stride_qt, stride_qh, stride_bt, stride_cblock, stride_chead, sliding_window, softcap, k_step,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, WARPS: tl.constexpr, WARP_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, V_CHUNKS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_CODE_BYTES: tl.constexpr,
    V_CODE_BYTES: tl.constexpr,
    K_NORM_OFF: tl.constexpr, V_CODE_OFF: tl.constexpr, V_NORM_OFF: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
    K_ASM: tl.constexpr, V_ASM: tl.constexpr,
):
    """Decode (one query token per sequence): each warp runs its own online softmax over its own tokens, so the
    loop has no reduction across warps. 4-bit keys meet int8 queries in integer MMAs (as in _attention_kernel),
    other widths fp16 queries.

    Tensors carry the warp as their leading axis, which Triton's batched MMA lays out one warp per batch entry
    (paged_attention launches WARPS = 1: a program of several warps meets a barrier every iteration).
    Scores are s = q K^T (query heads as rows, padded to ROWS >= 8), their row reductions stay inside a warp;
    the values' MMA is transposed, acc^T = V^T p^T, so p^T is the score tile's own registers (no shared memory)
    and the value codes load straight into the operand's (coordinate, token) order. The value tile decodes in
    V_CHUNKS pieces of the head dimension: fewer live registers. The warps' partials merge once at the end.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(qsl_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    LOG2E: tl.constexpr = 1.4426950408889634
    SCORE_UNIT: tl.constexpr = 1.0 if USE_SOFTCAP else LOG2E
    BLOCK_N: tl.constexpr = WARPS * WARP_N
    DH: tl.constexpr = D_PAD // 2
    DC: tl.constexpr = DH // V_CHUNKS  # value code bytes per chunk (2 coordinates each)

    g = tl.arange(0, ROWS)
    row_ok = g < GROUP
    head = kv_head * GROUP + g
    q_row = q_ptr + token * stride_qt + head * stride_qh
    if K_BITS == 4:
        qa_hi, qb_hi, qa_lo, qb_lo, q_gain, q_half = _int8_query(q_row[:, None], row_ok, k_step, HEAD_DIM, DH,
                                                                 SCORE_UNIT)
        # hi parts in rows 0 .. ROWS - 1, lo parts below: one MMA per key tile fills the 16 rows an MMA takes (a
        # padded row would be a copy, and ptxas moves copies into place before every MMA), and a thread holds row
        # r with row r + ROWS, so combining hi and lo stays in registers.
        qa = tl.reshape(tl.permute(tl.join(qa_hi, qa_lo), (2, 0, 1)), (2 * ROWS, DH))
        qb = tl.reshape(tl.permute(tl.join(qb_hi, qb_lo), (2, 0, 1)), (2 * ROWS, DH))
        qa = tl.broadcast_to(qa[None, :, :], (WARPS, 2 * ROWS, DH))  # every warp its own copy: batched MMA operands
        qb = tl.broadcast_to(qb[None, :, :], (WARPS, 2 * ROWS, DH))
    else:
        q_even, q_odd = _query_halves(q_row[:, None], row_ok, K_BITS, HEAD_DIM, DH)
        q_even = tl.broadcast_to(q_even[None, :, :], (WARPS, ROWS, DH))
        q_odd = tl.broadcast_to(q_odd[None, :, :], (WARPS, ROWS, DH))

    kv_lo = 0
    if USE_WINDOW:
        kv_lo = (tl.maximum(seq_len - sliding_window, 0) // BLOCK_N) * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(seq_len - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = kv_lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    m_i = tl.full((WARPS, ROWS), float("-inf"), tl.float32)
    l_i = tl.zeros((WARPS, ROWS), tl.float32)
    # acc^T of even / odd coordinates, first and (V_CHUNKS == 2) second half of the head dimension.
    acc_e0 = tl.zeros((WARPS, DC, ROWS), tl.float32)
    acc_o0 = tl.zeros((WARPS, DC, ROWS), tl.float32)
    acc_e1 = tl.zeros((WARPS, DC, ROWS), tl.float32)
    acc_o1 = tl.zeros((WARPS, DC, ROWS), tl.float32)
    slot = tl.arange(0, WARPS)[:, None] * WARP_N + tl.arange(0, WARP_N)[None, :]  # (warp, token) -> tile offset
    for n0 in range(start, end, BLOCK_N):
        n = n0 + slot
        n_ok = n < end  # the one query is the last token: this is the causal mask too
        if USE_WINDOW:
            n_ok &= n >= seq_len - sliding_window
        page, off = locate_tokens(block_table_ptr + seq * stride_bt, n, n_ok, stride_cblock, kv_head * stride_chead,
                                  BLOCK_SIZE)
        k_norm = tl.load((cache_ptr + page + K_NORM_OFF + off * 4).to(tl.pointer_type(tl.float32)), mask=n_ok,
                         other=0.0)
        k_rec = (page + off * K_CODE_BYTES)[:, None, :]
        if K_BITS == 4:
            ka, kb = load_int8_quads(cache_ptr, k_rec, n_ok[:, None, :], k_lut_ptr, K_ASM, HEAD_DIM, D_PAD, AXIS=1)
            s = _int_mma(qb, kb, _int_mma(qa, ka, tl.zeros((WARPS, 2 * ROWS, WARP_N), tl.int32), UPCAST), UPCAST)
            s_hi, s_lo = tl.split(tl.permute(tl.reshape(s, (WARPS, 2, ROWS, WARP_N)), (0, 2, 3, 1)))
            s = ((s_hi * 254 + s_lo).to(tl.float32) * q_gain[None, :, None] + q_half[None, :, None]) * k_norm[:, None, :]
        else:
            k_even, k_odd = load_halves(cache_ptr, k_rec, n_ok[:, None, :], k_lut_ptr, K_ASM, K_BITS, HEAD_DIM, DH,
                                        AXIS=1)
            s = mma(q_even, k_even, tl.zeros((WARPS, ROWS, WARP_N), tl.float32), UPCAST)
            s = mma(q_odd, k_odd, s, UPCAST) * (k_norm * SCORE_UNIT)[:, None, :]
        if USE_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0) * LOG2E  # softcap * tanh(s / softcap)
        v_norm = tl.load((cache_ptr + page + V_NORM_OFF + off * 4).to(tl.pointer_type(tl.float32)), mask=n_ok,
                         other=1.0)
        log_norm, inv_norm = _value_norm_terms(v_norm, UPCAST)
        s = tl.where(n_ok[:, None, :], s + log_norm[:, None, :], float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=2))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, :, None])
        l_i = l_i * alpha + tl.sum(p * inv_norm[:, None, :], axis=2)
        alpha = alpha[:, None, :]  # per acc^T column
        pt = tl.trans(p.to(tl.float16), (0, 2, 1))
        v_rec = (page + V_CODE_OFF + off * V_CODE_BYTES)[:, None, :]
        v_even, v_odd = load_halves(cache_ptr, v_rec, n_ok[:, None, :], v_lut_ptr, V_ASM, V_BITS, HEAD_DIM, DC,
                                    AXIS=1)
        acc_e0 = mma(v_even, pt, acc_e0 * alpha, UPCAST)
        acc_o0 = mma(v_odd, pt, acc_o0 * alpha, UPCAST)
        if V_CHUNKS == 2:  # coordinate pairs DC ..
            v_even, v_odd = load_halves(cache_ptr, v_rec, n_ok[:, None, :], v_lut_ptr, V_ASM, V_BITS, HEAD_DIM, DC,
                                        J0=DC, AXIS=1)
            acc_e1 = mma(v_even, pt, acc_e1 * alpha, UPCAST)
            acc_o1 = mma(v_odd, pt, acc_o1 * alpha, UPCAST)
        m_i = m_new

    # The warps' partials, merged: the one exchange across warps.
    m = tl.max(m_i, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(m_i - m_safe[None, :])
    out_rows = token * NUM_Q_HEADS + head
    part = part_acc_ptr + (out_rows[None, :] * NUM_SPLITS + split) * HEAD_DIM
    even = 2 * pair_index(tl.arange(0, DC), V_BITS, HEAD_DIM)
    ok = (even[:, None] < HEAD_DIM) & row_ok[None, :]
    tl.store(part + even[:, None], tl.sum(acc_e0 * w[:, None, :], axis=0), mask=ok)
    tl.store(part + even[:, None] + 1, tl.sum(acc_o0 * w[:, None, :], axis=0), mask=ok)
    if V_CHUNKS == 2:
        even = 2 * pair_index(DC + tl.arange(0, DC), V_BITS, HEAD_DIM)
        ok = (even[:, None] < HEAD_DIM) & row_ok[None, :]
        tl.store(part + even[:, None], tl.sum(acc_e1 * w[:, None, :], axis=0), mask=ok)
        tl.store(part + even[:, None] + 1, tl.sum(acc_o1 * w[:, None, :], axis=0), mask=ok)
    ml = part_ml_ptr + out_rows * (2 * NUM_SPLITS) + split
    tl.store(ml, m, mask=row_ok)
    tl.store(ml + NUM_SPLITS, tl.sum(l_i * w, axis=0), mask=row_ok)


def default_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int = NUM_SMS_DEFAULT,
                       programs_per_sm: int = 24) -> int:
    """Splits so that sequences x KV heads x splits give every SM about programs_per_sm programs (decode_launch's
    figure for the layout, rounded up to a power of two). Depends on batch shape only (graph-safe)."""
    programs = max(1, num_seqs * num_kv_heads)
    return max(1, min(32, next_pow2(math.ceil(programs_per_sm * num_sms / programs))))


def per_warp_decode(preset: Preset) -> bool:
    """Decode runs _decode_kernel except over 5-bit keys: their table gathers made k5v4 1.8x slower there than in
    the general kernel (benchmarks/results/decode_kernel_session9.log)."""
    return preset.k_bits != 5


@dataclass(frozen=True)
class AttentionLaunch:
    """How a layout's decode launches: what was measured to pay on the H200."""

    num_warps: int
    num_stages: int  # Triton's pipeline depth: 5 gives each of the loop's loads two buffers, 2..4 one
    max_registers: int  # per thread; 0: the compiler's choice
    programs_per_sm: int  # default_num_splits' target


def decode_launch(preset: Preset, head_dim: int) -> AttentionLaunch:
    """tq4 at head_dim <= 128: one-warp programs, loads two tiles ahead, 168 registers (12 programs fit an SM) and
    ~6 programs per SM, one wave: 1.07x the session-12 policy at 16 / 4 heads, 64 x 8k and 32 x 32k, 1.09x at head_dim
    64 (decode_kernel_session13.log). The narrower presets: one tile ahead (two buffers cost them 5%), 24 programs per
    SM, 168 registers at head_dim 65..128 (tq3 1.05x, tq2 1.09x over uncapped), as tq4 at head_dim 256
    (decode_kernel_session12.log). The general kernel (5-bit keys): four warps, 2 programs per SM, no cap (any
    loses: decode_kernel_registers.log)."""
    if not per_warp_decode(preset):
        return AttentionLaunch(4, 3, 0, 2)
    width = next_pow2(head_dim)
    if preset.k_bits == 4 and preset.v_bits == 4:
        return AttentionLaunch(1, 5, 168, 6) if width <= 128 else AttentionLaunch(1, 3, 0, 24)
    return AttentionLaunch(1, 3, 168 if width == 128 else 0, 24)


def attention_workspace_shape(num_tokens: int, num_q_heads: int, head_dim: int, num_splits: int) -> tuple[int]:
    """fp32 elements of scratch: each split's partials (accumulator, row max, row sum) per output row."""
    return (num_tokens * num_q_heads * num_splits * (head_dim + 2),)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: CacheLayout,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    max_query_len: int,
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None = None,
    softcap: float | None = None,
    workspace: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    key_calibration: KeyCalibration | None = None,
    max_registers: int | None = None,
    rotated_query: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of query (tokens, q_heads, head_dim) over the compressed pages, into out;
    key_calibration: the one the pages' keys were stored with (see core.calibration); num_splits, block_n,
    num_warps, num_stages, max_registers (per thread, 0: the compiler's choice): None takes decode_launch's choice
    for decode, the general kernel's otherwise. rotated_query: the query already in the cache's basis, as
    store_kv(..., query=query, query_scale=scale) returns it with the step's keys (one launch fewer)."""
    num_tokens, num_q_heads, head_dim = query.shape
    check_dtype("query", query)
    check_cache(kv_cache, layout)
    if head_dim != layout.head_dim:
        raise ValueError(f"query head_dim {head_dim} does not match the cache layout's {layout.head_dim}")
    if num_q_heads % layout.num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {layout.num_kv_heads} KV heads")
    if out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"out must match query: {tuple(query.shape)} {query.dtype}")
    for name, t in (("block_table", block_table), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        check_index(name, t, query)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_table.shape[0] < num_seqs:
        raise ValueError("query_start_loc needs num_seqs + 1 entries and block_table a row per sequence")
    if num_tokens == 0:
        return out
    group = num_q_heads // layout.num_kv_heads
    g_pad = next_pow2(group)
    decode_only = max_query_len == 1
    block_q = 1 if decode_only else max(1, 64 // g_pad)
    block_m = max(16, block_q * g_pad)
    per_warp = decode_only and per_warp_decode(layout.preset)
    launch = decode_launch(layout.preset, head_dim) if decode_only else AttentionLaunch(4, 3, 0, 1)
    num_warps = num_warps or launch.num_warps
    block_n = block_n or 32 * num_warps
    num_stages = num_stages or launch.num_stages
    max_registers = launch.max_registers if max_registers is None else max_registers
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, layout.num_kv_heads, programs_per_sm=launch.programs_per_sm) \
            if decode_only else 1
    need = attention_workspace_shape(num_tokens, num_q_heads, head_dim, num_splits)[0]
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=query.device)
    elif workspace.dtype != torch.float32 or workspace.numel() < need:
        raise ValueError(f"workspace must be float32 with >= {need} elements")
    rows = num_tokens * num_q_heads
    part_acc = workspace[: rows * num_splits * head_dim]
    part_ml = workspace[rows * num_splits * head_dim : need]

    if key_calibration is not None:
        check_calibration(key_calibration, layout)
    c = kernel_constants(layout, query.device)
    # MMA operands are fp16 whatever the model dtype (3 more mantissa bits than bf16, same speed), but for
    # 4-bit keys: int8 keys and int8 hi / lo parts of the queries (exact products, see the kernel).
    if rotated_query is None:
        q_rot = rotate_queries(query, layout, scale, key_calibration, torch.float16)
    elif rotated_query.shape != query.shape or rotated_query.dtype != torch.float16 or rotated_query.stride(2) != 1:
        raise ValueError(f"rotated_query must be float16 of the query's shape {tuple(query.shape)}")
    else:
        q_rot = rotated_query
    common = dict(
        NUM_Q_HEADS=num_q_heads, GROUP=group, NUM_SPLITS=num_splits, **page_constants(layout),
        USE_WINDOW=bool(sliding_window), USE_SOFTCAP=bool(softcap), UPCAST=INTERPRETED,
        K_ASM="" if INTERPRETED else c.key_mma_asm, V_ASM="" if INTERPRETED else c.value_lookup_asm,
        num_warps=num_warps, num_stages=num_stages, **({"maxnreg": max_registers} if max_registers else {}),
    )
    k_table = c.key_int8 if layout.preset.k_bits == 4 else c.key_values[torch.float16]
    strides = (q_rot.stride(0), q_rot.stride(1), block_table.stride(0), kv_cache.stride(0), kv_cache.stride(1))
    if per_warp:
        _decode_kernel[(num_seqs, layout.num_kv_heads, num_splits)](
            q_rot, kv_cache, block_table, query_start_loc, seq_lens, k_table, c.value_values[torch.float16],
            part_acc, part_ml, *strides, sliding_window or 0, float(softcap or 0.0), c.key_int8_step,
            ROWS=max(8, g_pad), WARPS=num_warps, WARP_N=block_n // num_warps, V_CHUNKS=2 if head_dim > 64 else 1,
            **common,
        )
    else:
        grid_q = num_seqs if decode_only else num_tokens // block_q + num_seqs
        _attention_kernel[(grid_q, layout.num_kv_heads, num_splits)](
            q_rot, kv_cache, block_table, query_start_loc, seq_lens, k_table, c.value_values[torch.float16],
            part_acc, part_ml, num_seqs, *strides, sliding_window or 0, float(softcap or 0.0), c.key_int8_step,
            G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, DECODE_ONLY=decode_only,
            **common,
        )
    return merge_and_unrotate(part_acc, part_ml, num_splits, out, layout)
