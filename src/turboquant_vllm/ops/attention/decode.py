"""The decode kernel: programs of one warp, one query token each, with its own online softmax over its split of the
context (no barrier ties a warp to another). A sequence of several query tokens (a speculative verification) runs
them as that many decodes, each over its own causal prefix: a verified position computes exactly what decoding it
would. Every preset but 5-bit keys decodes here (launch.per_warp_decode). Entry point: attention.paged_attention."""

import triton
import triton.language as tl

from ..utils import load_halves, load_int8_quads, locate_tokens, mma, pair_index
from .tiles import int8_query, int_mma, query_halves, value_norm_terms


@triton.jit(do_not_specialize=["stride_bt"])  # the block table's width: one compile for all (ops.warmup)
def _decode_kernel(
    q_ptr, q_offset_ptr, cache_ptr, block_table_ptr, qsl_ptr, seq_lens_ptr, k_lut_ptr, v_lut_ptr, part_acc_ptr,
    part_ml_ptr, stride_qt, stride_qh, stride_bt, stride_cblock, stride_chead, sliding_window, softcap, k_step,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_SPLIT: tl.constexpr, WARPS: tl.constexpr,
    WARP_N: tl.constexpr,
    QUERY_LEN: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_SPLIT_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    V_CHUNKS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_CODE_BYTES: tl.constexpr,
    V_CODE_BYTES: tl.constexpr,
    K_NORM_OFF: tl.constexpr, V_CODE_OFF: tl.constexpr, V_NORM_OFF: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, CALIBRATED: tl.constexpr, UPCAST: tl.constexpr,
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
    CALIBRATED: keys stored with a key calibration; an uncentered one (negative norm) loses its query's offset.
    HEAD_SPLIT: programs a KV head's query heads are dealt to, ROWS each (axis 1: KV head x HEAD_SPLIT).
    QUERY_LEN: query slots a sequence (programs along axis 0); the i-th token of a sequence of q tokens attends its
    first seq_len - (q - 1 - i) keys, and slots past q do nothing.
    """
    seq = tl.program_id(0) // QUERY_LEN
    kv_head = tl.program_id(1) // HEAD_SPLIT
    split = tl.program_id(2)
    token = tl.load(qsl_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    live = True
    if QUERY_LEN > 1:
        i = tl.program_id(0) % QUERY_LEN
        q_len = tl.load(qsl_ptr + seq + 1) - token
        live = i < q_len
        token += i
        seq_len = tl.where(live, seq_len - (q_len - 1 - i), 0)  # an empty slot runs no tile and writes nothing
    LOG2E: tl.constexpr = 1.4426950408889634
    SCORE_UNIT: tl.constexpr = 1.0 if USE_SOFTCAP else LOG2E
    BLOCK_N: tl.constexpr = WARPS * WARP_N
    DH: tl.constexpr = D_PAD // 2
    DC: tl.constexpr = DH // V_CHUNKS  # value code bytes per chunk (2 coordinates each)

    g = tl.arange(0, ROWS) + (tl.program_id(1) % HEAD_SPLIT) * ROWS  # this program's query heads of the group
    row_ok = (g < GROUP) & live
    head = kv_head * GROUP + g
    q_row = q_ptr + token * stride_qt + head * stride_qh
    if K_BITS == 4:
        qa_hi, qb_hi, qa_lo, qb_lo, q_gain, q_half = int8_query(q_row[:, None], row_ok, k_step, HEAD_DIM, DH,
                                                                 SCORE_UNIT)
        # hi parts in rows 0 .. ROWS - 1, lo parts below: one MMA per key tile fills the 16 rows an MMA takes (a
        # padded row would be a copy, and ptxas moves copies into place before every MMA), and a thread holds row
        # r with row r + ROWS, so combining hi and lo stays in registers.
        qa = tl.reshape(tl.permute(tl.join(qa_hi, qa_lo), (2, 0, 1)), (2 * ROWS, DH))
        qb = tl.reshape(tl.permute(tl.join(qb_hi, qb_lo), (2, 0, 1)), (2 * ROWS, DH))
        qa = tl.broadcast_to(qa[None, :, :], (WARPS, 2 * ROWS, DH))  # every warp its own copy: batched MMA operands
        qb = tl.broadcast_to(qb[None, :, :], (WARPS, 2 * ROWS, DH))
    else:
        q_even, q_odd = query_halves(q_row[:, None], row_ok, K_BITS, HEAD_DIM, DH)
        q_even = tl.broadcast_to(q_even[None, :, :], (WARPS, ROWS, DH))
        q_odd = tl.broadcast_to(q_odd[None, :, :], (WARPS, ROWS, DH))
    if CALIBRATED:  # in score units: the scale of q_gain / k_norm * SCORE_UNIT below
        q_offset = tl.load(q_offset_ptr + token * NUM_Q_HEADS + head, mask=row_ok, other=0.0)
        q_offset = (q_offset * SCORE_UNIT)[None, :, None]

    kv_lo = 0
    if USE_WINDOW:
        kv_lo = (tl.maximum(seq_len - sliding_window, 0) // BLOCK_N) * BLOCK_N
    # At least MIN_SPLIT_TOKENS a split: the splits past a short context run no tile and leave an empty partial
    # (m = -inf, l = 0) that the merge weighs zero.
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N, MIN_SPLIT_TOKENS)
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
        if CALIBRATED:  # a negative norm marks an uncentered key (core.calibration)
            k_uncentered = (k_norm < 0).to(tl.float32)[:, None, :]
            k_norm = tl.abs(k_norm)
        k_rec = (page + off * K_CODE_BYTES)[:, None, :]
        if K_BITS == 4:
            ka, kb = load_int8_quads(cache_ptr, k_rec, n_ok[:, None, :], k_lut_ptr, K_ASM, HEAD_DIM, D_PAD, AXIS=1)
            s = int_mma(qb, kb, int_mma(qa, ka, tl.zeros((WARPS, 2 * ROWS, WARP_N), tl.int32), UPCAST), UPCAST)
            s_hi, s_lo = tl.split(tl.permute(tl.reshape(s, (WARPS, 2, ROWS, WARP_N)), (0, 2, 3, 1)))
            s = ((s_hi * 254 + s_lo).to(tl.float32) * q_gain[None, :, None] + q_half[None, :, None]) * k_norm[:, None, :]
        else:
            k_even, k_odd = load_halves(cache_ptr, k_rec, n_ok[:, None, :], k_lut_ptr, K_ASM, K_BITS, HEAD_DIM, DH,
                                        AXIS=1)
            s = mma(q_even, k_even, tl.zeros((WARPS, ROWS, WARP_N), tl.float32), UPCAST)
            s = mma(q_odd, k_odd, s, UPCAST) * (k_norm * SCORE_UNIT)[:, None, :]
        if CALIBRATED:
            s -= q_offset * k_uncentered
        if USE_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0) * LOG2E  # softcap * tanh(s / softcap)
        v_norm = tl.load((cache_ptr + page + V_NORM_OFF + off * 4).to(tl.pointer_type(tl.float32)), mask=n_ok,
                         other=1.0)
        log_norm, inv_norm = value_norm_terms(v_norm, UPCAST)
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
