"""Into and out of the cache's rotated basis: queries before paged attention, outputs after.

References: naive.rotate_queries_reference ((q * key scale) @ R.T * scale), naive.query_offsets_reference
(q.key mean * scale, under a key calibration) and merge_and_unrotate_reference (the split merge, then @ R, for both
of merge_and_unrotate's launches), R being core.rotation's matrix (fp32).

Each direction is one launch that also does what used to be separate torch ops around it (the
key calibration's query scale, the softmax scale, the split merge, the casts): a decode step has
a few hundred rows, where a GEMM library call alone took 5.8-9 µs. The
product runs on tensor cores in 3xTF32 (fp32 accuracy: the split a = a_hi + a_lo recovers the
bits one TF32 operand drops).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...core.calibration import KeyCalibration
from ...core.layout import CacheLayout
from ..constants import kernel_constants
from ..utils import INTERPRETED, dot_fp32, next_pow2, round_to

LARGE_ROWS = 4096  # rows (tokens x query heads) above which a launch takes the wide tiles
# Up to SPREAD_ROWS rows, the rotations spread over blocks of output columns (_spread_rotation_kernel): one launch
# over a few row tiles leaves most SMs idle and each program walking R in K steps, one L2 round trip each (H100, one
# sequence of 32 q heads: the merge 15.0 us at d 128, 61.2 us at d 256; spread 4.7 and 8.4 in two launches).
SPREAD_ROWS = 128
SPREAD_BLOCK_R = 16
# K of each independent MMA chain of a spread rotation: H100 (benchmarks/results/kernel_variants/
# h100-spread-rotation-mma-chains.log at commit 98a39d8), one launch at d 128 2.86 -> 2.73 us (32 rows), at d 256
# 6.14 -> 5.28 (7.18 -> 5.38 at 128 rows); 32 lost to one chain.
SPREAD_BLOCK_K = 64
SPREAD = 0  # merge_and_unrotate's rows_per_program for the spread merge


def launch_shape(rows: int, head_dim: int) -> tuple[int, int]:
    """(rows per program, warps): 16 rows spread a decode step's few over many SMs; 64 rows (8 warps,
    to hold the accumulator without spilling) read R (64 KB at d 128) 4x less often from L2."""
    return (64, 8) if rows > LARGE_ROWS and head_dim <= 128 else (16, 4)


@triton.jit
def matrix_rows(m_ptr, k0, stride_k, stride_j, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """Rows k0 .. k0 + BLOCK_K of the fp32 matrix M[k, j] = m_ptr[k * stride_k + j * stride_j], zero-padded."""
    k = k0 + tl.arange(0, BLOCK_K)
    j = tl.arange(0, D_PAD)
    return tl.load(m_ptr + k[:, None] * stride_k + j[None, :] * stride_j,
                   mask=(k[:, None] < HEAD_DIM) & (j[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def rotate_rows(src_ptr, row_base, valid, rot_ptr, mean_ptr, scale_ptr, cal_base, center, CALIBRATION: tl.constexpr,
                HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                INTERPRET: tl.constexpr):
    """(x @ R.T, sum of x^2) in fp32 for the rows x at src_ptr + row_base ((BLOCK_R, 1) offsets), masked by valid.
    CALIBRATION 0: x = the rows; 1 (keys under a key calibration): (rows - mean) / scale where center ((BLOCK_R,)
    bool), rows / scale elsewhere; 2 (queries under one): rows * scale, and the second result is rows.mean instead
    (core.calibration's query offset); mean and scale rows at mean_ptr / scale_ptr + cal_base (broadcasting over
    the rows)."""
    sq = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, D_PAD), tl.float32)
    for k0 in tl.static_range(0, D_PAD, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)[None, :]
        ok = valid[:, None] & (k < HEAD_DIM)
        x = tl.load(src_ptr + row_base + k, mask=ok, other=0.0).to(tl.float32)
        if CALIBRATION == 1:
            mean = tl.load(mean_ptr + cal_base + k, mask=k < HEAD_DIM, other=0.0)
            scale = tl.load(scale_ptr + cal_base + k, mask=k < HEAD_DIM, other=1.0)
            x = tl.where(ok, (x - tl.where(center[:, None], mean, 0.0)) / scale, 0.0)
        elif CALIBRATION == 2:
            sq += tl.sum(x * tl.load(mean_ptr + cal_base + k, mask=k < HEAD_DIM, other=0.0), axis=1)
            x *= tl.load(scale_ptr + cal_base + k, mask=k < HEAD_DIM, other=0.0)
        if CALIBRATION != 2:
            sq += tl.sum(x * x, axis=1)
        acc = dot_fp32(x, matrix_rows(rot_ptr, k0, 1, HEAD_DIM, BLOCK_K, HEAD_DIM, D_PAD), acc, INTERPRET)
    return acc, sq


@triton.jit
def center_keys(src_ptr, row_base, valid, mean_ptr, scale_ptr, cal_base, HEAD_DIM: tl.constexpr,
                D_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Whether each key row is stored centered: ||(row - mean) / scale|| <= ||row / scale||
    (core.calibration.KeyCalibration.choose_keys); the CALIBRATION 1 center of rotate_rows."""
    sq_c = tl.zeros((BLOCK_R,), tl.float32)
    sq_u = tl.zeros((BLOCK_R,), tl.float32)
    for k0 in tl.static_range(0, D_PAD, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)[None, :]
        ok = valid[:, None] & (k < HEAD_DIM)
        x = tl.load(src_ptr + row_base + k, mask=ok, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + cal_base + k, mask=k < HEAD_DIM, other=0.0)
        scale = tl.load(scale_ptr + cal_base + k, mask=k < HEAD_DIM, other=1.0)
        c = tl.where(ok, (x - mean) / scale, 0.0)
        u = x / scale
        sq_c += tl.sum(c * c, axis=1)
        sq_u += tl.sum(u * u, axis=1)
    return sq_c <= sq_u


# Row and head counts change with every batch: specializing on them would recompile mid-serving.
@triton.jit(do_not_specialize=["num_rows", "num_q_heads", "group"])
def _rotate_queries_kernel(
    q_ptr, out_ptr, offset_ptr, rot_ptr, key_mean_ptr, key_scale_ptr, num_rows, num_q_heads, group, stride_qt,
    stride_qh, scale, CALIBRATION: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """out[row] = (q[row] * key scale of its KV head (CALIBRATION 2)) @ R.T * scale; rows are (token, query head).
    CALIBRATION 2 also writes offset[row] = q[row].key mean * scale (fp32)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    token = rows // num_q_heads
    head = rows % num_q_heads
    acc, offset = rotate_rows(q_ptr, (token * stride_qt + head * stride_qh)[:, None], row_ok, rot_ptr, key_mean_ptr,
                              key_scale_ptr, ((head // group) * HEAD_DIM)[:, None], row_ok, CALIBRATION, HEAD_DIM,
                              D_PAD, BLOCK_R, BLOCK_K, INTERPRET)
    j = tl.arange(0, D_PAD)
    out = round_to(acc * scale, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + rows[:, None] * HEAD_DIM + j[None, :], out, mask=row_ok[:, None] & (j[None, :] < HEAD_DIM))
    if CALIBRATION == 2:
        tl.store(offset_ptr + rows, offset * scale, mask=row_ok)


@triton.jit
def split_weights(ml_ptr, rows, s, s_ok, NUM_SPLITS: tl.constexpr):
    """(rows, splits) fp32: each split's share of its row's softmax, from the row maxima (log2) and sums in ml;
    rows and s broadcast to (rows, splits), s_ok masks the padding. A row that saw no key gets weights 0."""
    ml = ml_ptr + rows * (2 * NUM_SPLITS) + s
    m = tl.load(ml, mask=s_ok, other=float("-inf"))
    l_part = tl.load(ml + NUM_SPLITS, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max[:, None])
    total = tl.sum(w * l_part, axis=1)
    return w / tl.where(total == 0.0, 1.0, total)[:, None]


@triton.jit(do_not_specialize=["num_rows", "num_q_heads"])
def _merge_and_unrotate_kernel(
    acc_ptr, ml_ptr, out_ptr, rot_ptr, num_rows, num_q_heads, stride_ot, stride_oh, NUM_SPLITS: tl.constexpr,
    S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    """out[row] = o[row] @ R, cast to out's dtype, o the softmax merge of NUM_SPLITS partials (unnormalized acc
    (rows, splits, d), row maxima (log2) and sums in ml); any number of splits, padded to S_PAD = a power of two.
    Each program merges ROWS <= BLOCK_R rows (the MMA's tile keeps BLOCK_R >= 16; the rest masked)."""
    r = tl.arange(0, BLOCK_R)
    rows = tl.program_id(0) * ROWS + r
    row_ok = (r < ROWS) & (rows < num_rows)
    s = tl.arange(0, S_PAD)
    s_ok = row_ok[:, None] & (s[None, :] < NUM_SPLITS)
    w = split_weights(ml_ptr, rows[:, None], s[None, :], s_ok, NUM_SPLITS)
    acc = tl.zeros((BLOCK_R, D_PAD), tl.float32)
    for k0 in tl.static_range(0, D_PAD, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (k[None, :] < HEAD_DIM)
        part = tl.load(acc_ptr + (rows[:, None, None] * NUM_SPLITS + s[None, :, None]) * HEAD_DIM + k[None, None, :],
                       mask=ok[:, None, :] & s_ok[:, :, None], other=0.0)
        x = tl.sum(part * w[:, :, None], axis=1)
        acc = dot_fp32(x, matrix_rows(rot_ptr, k0, HEAD_DIM, 1, BLOCK_K, HEAD_DIM, D_PAD), acc, INTERPRET)
    token = rows // num_q_heads
    head = rows % num_q_heads
    j = tl.arange(0, D_PAD)
    out = round_to(acc, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + j[None, :], out,
             mask=row_ok[:, None] & (j[None, :] < HEAD_DIM))


@triton.jit
def _merge_splits_kernel(acc_ptr, ml_ptr, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """acc[row, 0, columns] <- the softmax merge of the row's NUM_SPLITS partials over one block of columns, in
    place: that block of the row's partials is read by this program alone."""
    row = tl.program_id(0)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    s = tl.arange(0, S_PAD)
    s_ok = s < NUM_SPLITS
    w = split_weights(ml_ptr, row, s[None, :], s_ok[None, :], NUM_SPLITS)  # (1, S_PAD)
    k_ok = k < HEAD_DIM
    base = acc_ptr + row.to(tl.int64) * (NUM_SPLITS * HEAD_DIM)
    part = tl.load(base + s[:, None] * HEAD_DIM + k[None, :], mask=s_ok[:, None] & k_ok[None, :], other=0.0)
    tl.store(base + k[None, :], tl.sum(part * tl.trans(w), axis=0, keep_dims=True), mask=k_ok[None, :])


@triton.jit(do_not_specialize=["num_rows", "num_q_heads", "stride_xt", "stride_xh"])
def _spread_rotation_kernel(x_ptr, out_ptr, rot_ptr, num_rows, num_q_heads, stride_xt, stride_xh, stride_ot, stride_oh,
                            scale, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
                            INTERPRET: tl.constexpr):
    """out[row, columns] = x[row] @ M[:, columns] * scale, M = R (TRANSPOSE: R.T), rows = (token, q head) at x_ptr +
    token * stride_xt + head * stride_xh, cast to out's dtype: a block of rows and of output columns a program,
    each operand one load (one round trip to L2, not one per K step). The product is D_PAD / BLOCK_K independent
    MMA chains of BLOCK_K, summed in order: one chain over the whole K is a latency chain."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    token = rows // num_q_heads
    head = rows % num_q_heads
    x_row = x_ptr + (token.to(tl.int64) * stride_xt + head * stride_xh)[:, None]
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    acc = tl.zeros((BLOCK_R, BLOCK_J), tl.float32)
    zero = acc + scale * 0.0  # a zero Triton cannot fold: dot(a, b, 0) + acc would become one chain again
    for k0 in tl.static_range(0, D_PAD, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + k[None, :], mask=row_ok[:, None] & (k[None, :] < HEAD_DIM), other=0.0).to(tl.float32)
        m_ok = (k[:, None] < HEAD_DIM) & (j[None, :] < HEAD_DIM)
        if TRANSPOSE:
            m = tl.load(rot_ptr + j[None, :] * HEAD_DIM + k[:, None], mask=m_ok, other=0.0)
        else:
            m = tl.load(rot_ptr + k[:, None] * HEAD_DIM + j[None, :], mask=m_ok, other=0.0)
        acc += dot_fp32(x, m, zero, INTERPRET)
    out = round_to(acc * scale, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + j[None, :], out,
             mask=row_ok[:, None] & (j[None, :] < HEAD_DIM))


def _spread_rotation(x: torch.Tensor, out: torch.Tensor, rotation: torch.Tensor, stride_xt: int, stride_xh: int,
                     scale: float, transpose: bool, block_k: int | None = None) -> None:
    """out (tokens, q_heads, head_dim) = the rows of x (token, q head strides) @ R (or R.T) * scale; block_k: the
    K of each independent MMA chain (None: SPREAD_BLOCK_K)."""
    tokens, q_heads, head_dim = out.shape
    d_pad = next_pow2(head_dim)
    block_j = max(16, 4096 // d_pad)  # a program's block of R: 4k elements
    _spread_rotation_kernel[(triton.cdiv(tokens * q_heads, SPREAD_BLOCK_R), triton.cdiv(head_dim, block_j))](
        x, out, rotation, tokens * q_heads, q_heads, stride_xt, stride_xh, out.stride(0), out.stride(1), float(scale),
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_R=SPREAD_BLOCK_R, BLOCK_J=block_j,
        BLOCK_K=min(d_pad, block_k or SPREAD_BLOCK_K), TRANSPOSE=transpose, INTERPRET=INTERPRETED, num_warps=4)


class RotatedQuery(NamedTuple):
    """Queries in the cache's basis, as paged_attention(rotated_query=...) takes them."""

    query: torch.Tensor  # (tokens, q_heads, head_dim): (q * key scale) @ R.T * softmax scale
    offset: torch.Tensor | None  # key calibration only: (tokens, q_heads) fp32 q.key mean * softmax scale, what the
    # kernels subtract from the score of an uncentered key (core.calibration)

    def tokens(self, lo: int, hi: int) -> RotatedQuery:
        """Tokens lo .. hi (a step's decodes or its prefills)."""
        return RotatedQuery(self.query[lo:hi], None if self.offset is None else self.offset[lo:hi])


def rotate_queries(
    query: torch.Tensor, layout: CacheLayout, scale: float, key_calibration: KeyCalibration | None = None,
    dtype: torch.dtype = torch.float16, spread: bool = True,
) -> RotatedQuery:
    """query (tokens, q_heads, head_dim) into the rotated basis, times the key calibration's scale and
    `scale` (the inner loops then work on codes directly): a new contiguous tensor of `dtype`, and with the key
    calibration the queries' offsets. spread: up to SPREAD_ROWS rows without a calibration take the spread kernel;
    False: one kernel whatever the row count, so a row's bits do not depend on the batch (batch-invariant mode)."""
    tokens, q_heads, head_dim = query.shape
    if query.stride(2) != 1:
        raise ValueError("query must be contiguous in head_dim")
    out = torch.empty(query.shape, dtype=dtype, device=query.device)
    offset = None
    if key_calibration is not None:
        offset = torch.empty((tokens, q_heads), dtype=torch.float32, device=query.device)
    rows = tokens * q_heads
    if rows == 0:
        return RotatedQuery(out, offset)
    rotation = kernel_constants(layout, query.device).rotation
    if spread and key_calibration is None and rows <= SPREAD_ROWS:
        _spread_rotation(query, out, rotation, query.stride(0), query.stride(1), scale, transpose=True)
        return RotatedQuery(out, offset)
    # any valid pointers without a calibration
    key_mean, key_scale = (key_calibration.mean, key_calibration.scale) if key_calibration else (rotation, rotation)
    block_r, warps = launch_shape(rows, head_dim)
    _rotate_queries_kernel[(triton.cdiv(rows, block_r),)](
        query, out, out if offset is None else offset, rotation, key_mean, key_scale, rows, q_heads,
        q_heads // layout.num_kv_heads, query.stride(0), query.stride(1), float(scale),
        CALIBRATION=2 if key_calibration is not None else 0, HEAD_DIM=head_dim,
        D_PAD=next_pow2(head_dim), BLOCK_R=block_r, BLOCK_K=32, INTERPRET=INTERPRETED, num_warps=warps,
    )
    return RotatedQuery(out, offset)


def merge_and_unrotate(part_acc: torch.Tensor, part_ml: torch.Tensor, num_splits: int, out: torch.Tensor,
                       layout: CacheLayout, rows_per_program: int | None = None) -> torch.Tensor:
    """out = (softmax merge of the split partials) @ R: part_acc (rows, splits, head_dim) unnormalized
    accumulators, part_ml (rows, 2, splits) log2-domain row maxima and sums, rows = (token, q head).
    rows_per_program: 1 .. the launch's tile rows (launch_shape; the default): fewer spread a small batch's
    partials over more programs. 0 (SPREAD): two launches spread over the GPU, for few rows (up to SPREAD_ROWS: a
    decode step of a few sequences, each with many splits): each row's partials merged per block of columns (into
    the row's first split slot, in place: part_acc is scratch), then those rows times R per block of output
    columns."""
    tokens, q_heads, head_dim = out.shape
    if out.stride(2) != 1:
        raise ValueError("out must be contiguous in head_dim")
    rows = tokens * q_heads
    if rows == 0:
        return out
    rotation = kernel_constants(layout, out.device).rotation
    s_pad, d_pad = next_pow2(num_splits), next_pow2(head_dim)
    if rows_per_program == SPREAD:
        block_k = min(d_pad, max(16, 2048 // s_pad))  # a program's partials: about 2k elements, one load
        _merge_splits_kernel[(rows, triton.cdiv(head_dim, block_k))](
            part_acc, part_ml, NUM_SPLITS=num_splits, S_PAD=s_pad, HEAD_DIM=head_dim, BLOCK_K=block_k, num_warps=4)
        _spread_rotation(part_acc, out, rotation, q_heads * num_splits * head_dim, num_splits * head_dim, 1.0,
                         transpose=False)
        return out
    block_r, warps = launch_shape(rows, head_dim)
    per_program = rows_per_program or block_r
    if not 1 <= per_program <= block_r:
        raise ValueError(f"rows_per_program must lie in [1, {block_r}] or be {SPREAD}, got {rows_per_program}")
    _merge_and_unrotate_kernel[(triton.cdiv(rows, per_program),)](
        part_acc, part_ml, out, rotation, rows, q_heads, out.stride(0), out.stride(1), NUM_SPLITS=num_splits,
        S_PAD=s_pad, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_R=block_r, ROWS=per_program,
        BLOCK_K=max(16, min(32, 512 // (s_pad * block_r // 16))), INTERPRET=INTERPRETED, num_warps=warps,
    )
    return out
