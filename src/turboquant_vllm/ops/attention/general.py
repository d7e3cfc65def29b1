"""The general attention kernel: tiles of query tokens (prefill, chunked prefill, speculative verification, and
decode over 5-bit keys), four warps sharing one online softmax per tile. Entry point: attention.paged_attention."""

import triton
import triton.language as tl

from ..utils import load_halves, load_int8_quads, locate_tokens, mma, pair_index
from .tiles import int8_query, int_mma, query_halves, value_norm_terms


# num_seqs changes with every batch, stride_bt with max_model_len, and a mixed batch's prefill rows start
# mid-tensor (any alignment): none of them recompiles (ops.warmup)
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"],
            do_not_specialize_on_alignment=["q_offset_ptr", "block_table_ptr", "qsl_ptr", "seq_lens_ptr"])
def _attention_kernel(
    q_ptr, q_offset_ptr, cache_ptr, block_table_ptr, qsl_ptr, seq_lens_ptr, k_lut_ptr, v_lut_ptr,
    part_acc_ptr, part_ml_ptr,
    num_seqs, stride_qt, stride_qh, stride_bt, stride_cblock, stride_chead, sliding_window, softcap, k_step,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DECODE_ONLY: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_CODE_BYTES: tl.constexpr, V_CODE_BYTES: tl.constexpr,
    K_NORM_OFF: tl.constexpr, V_CODE_OFF: tl.constexpr, V_NORM_OFF: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, CALIBRATED: tl.constexpr, UPCAST: tl.constexpr,
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
    if K_BITS == 4:  # 4-bit keys are int8 (ops.utils.load_int8_quads), so are the queries
        qa_hi, qb_hi, qa_lo, qb_lo, q_gain, q_half = int8_query(q_row, row_ok, k_step, HEAD_DIM, DH, SCORE_UNIT)
    else:
        q_even, q_odd = query_halves(q_row, row_ok, K_BITS, HEAD_DIM, DH)
    if CALIBRATED:  # subtracted from the scores of uncentered keys (core.calibration), in score units
        q_offset = tl.load(q_offset_ptr + token * NUM_Q_HEADS + head, mask=row_ok, other=0.0)
        q_offset = (q_offset * SCORE_UNIT)[:, None]
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
        if CALIBRATED:  # a negative norm marks an uncentered key
            k_uncentered = (k_norm < 0).to(tl.float32)[None, :]
            k_norm = tl.abs(k_norm)
        if K_BITS == 4:
            ka, kb = load_int8_quads(cache_ptr, (page + off * K_CODE_BYTES)[:, None], n_ok[:, None], k_lut_ptr, K_ASM,
                                     HEAD_DIM, D_PAD)
            ka = tl.trans(ka)
            kb = tl.trans(kb)
            s = int_mma(qb_hi, kb, int_mma(qa_hi, ka, tl.zeros((BLOCK_M, BLOCK_N), tl.int32), UPCAST), UPCAST)
            s = int_mma(qb_lo, kb, int_mma(qa_lo, ka, s * 254, UPCAST), UPCAST)
            s = (s.to(tl.float32) * q_gain[:, None] + q_half[:, None]) * k_norm[None, :]
        else:
            k_even, k_odd = load_halves(cache_ptr, (page + off * K_CODE_BYTES)[:, None], n_ok[:, None], k_lut_ptr,
                                        K_ASM, K_BITS, HEAD_DIM, DH)
            s = mma(q_even, tl.trans(k_even), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), UPCAST)
            s = mma(q_odd, tl.trans(k_odd), s, UPCAST) * (k_norm * SCORE_UNIT)[None, :]
        if CALIBRATED:
            s -= q_offset * k_uncentered
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
        log_norm, inv_norm = value_norm_terms(v_norm, UPCAST)
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

    # Partials of this split; ops.rotation merges the splits and leaves the rotated basis.
    out_rows = token[:, None] * NUM_Q_HEADS + head[:, None]
    even = 2 * pair_index(tl.arange(0, DH), V_BITS, HEAD_DIM)
    d_ok = row_ok[:, None] & (even[None, :] < HEAD_DIM)
    part = part_acc_ptr + (out_rows * NUM_SPLITS + split) * HEAD_DIM + even[None, :]
    tl.store(part, acc_even, mask=d_ok)
    tl.store(part + 1, acc_odd, mask=d_ok)
    ml = part_ml_ptr + (token * NUM_Q_HEADS + head) * (2 * NUM_SPLITS) + split
    tl.store(ml, m_i, mask=row_ok)
    tl.store(ml + NUM_SPLITS, l_i, mask=row_ok)
