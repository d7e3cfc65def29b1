"""Building blocks of both attention kernels: integer MMAs, query operands, value-norm terms."""

import triton
import triton.language as tl

from ..utils import pair_index


@triton.jit
def int_mma(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b of int8 operands: int32 and exact on the GPU; fp32 when interpreted (see ops.utils.mma)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc.to(tl.float32))
    return tl.dot(a, b, acc, out_dtype=tl.int32)


@triton.jit
def int8_query(q_row, row_ok, k_step, HEAD_DIM: tl.constexpr, DH: tl.constexpr, SCORE_UNIT: tl.constexpr):
    """The query rows at q_row ((rows, 1) pointers) as quads in the order of the int8 key tiles
    (ops.utils.load_int8_quads: coordinates 8i + 0..3, then 8i + 4..7), each q = q_step * (hi + lo / 254), hi
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
def query_halves(q_row, row_ok, BITS: tl.constexpr, HEAD_DIM: tl.constexpr, DH: tl.constexpr):
    """The query rows at q_row ((rows, 1) pointers) as (even, odd) coordinates in the order of the key tiles' pairs
    (ops.utils.pair_index), (rows, DH) each."""
    col = 2 * pair_index(tl.arange(0, DH), BITS, HEAD_DIM)
    ok = row_ok[:, None] & (col[None, :] < HEAD_DIM)
    q_even = tl.load(q_row + col[None, :], mask=ok, other=0.0)
    q_odd = tl.load(q_row + col[None, :] + 1, mask=ok, other=0.0)
    return q_even, q_odd


@triton.jit
def value_norm_terms(v_norm, UPCAST: tl.constexpr):
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
