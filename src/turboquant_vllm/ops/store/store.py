"""Store: rotate, normalize, quantize, pack and norm-correct new keys/values into the paged cache.

Reference: naive.store_kv_reference (bit-exact up to fp32 rounding of
the rotation). One launch writes K and V (grid axis 2 picks which), key calibration and rotation
included: a decode step's few tokens make a GEMM library call cost more than the whole store.
The same launch can also rotate the step's decode queries (ops.rotation.rotate_queries'
result, reference rotation.naive.rotate_queries_reference): one launch per layer fewer in every decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.calibration import MIN_UNCENTERED_NORM, KeyCalibration
from ...core.layout import CacheLayout
from ..constants import kernel_constants
from ..rotation.rotation import RotatedQuery, center_keys, rotate_rows
from ..utils import (
    INTERPRETED,
    check_cache,
    check_calibration,
    check_dtype,
    check_index,
    codes_to_plane_bytes,
    page_constants,
    round_to,
)

_UNCENTERED_FLOOR = tl.constexpr(MIN_UNCENTERED_NORM)
STORE_LARGE_BATCH = 1024  # tokens from which a store launch takes larger tiles (store_block_tokens)


@triton.jit
def _store_plane(cache_ptr, base, valid, code, PLANE_START: tl.constexpr, WIDTH: tl.constexpr, SLICED: tl.constexpr,
                 HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """Pack the codes (< 2^WIDTH) of BLOCK_T records and store them at their plane's bytes (SLICED: byte r of
    group g of 8 coordinates at r * HEAD_DIM / 8 + g, see core.packing)."""
    packed = codes_to_plane_bytes(code, BLOCK_T, D_PAD, WIDTH)
    j = tl.arange(0, D_PAD * WIDTH // 8)
    at = j
    if SLICED:
        at = (j % WIDTH) * (HEAD_DIM // 8) + j // WIDTH
    tl.store(cache_ptr + base[:, None] + PLANE_START + at[None, :], packed,
             mask=valid[:, None] & (j[None, :] < HEAD_DIM * WIDTH // 8))


@triton.jit
def _quantize_and_store(
    src_ptr, stride_t, stride_h, rot_ptr, mean_ptr, scale_ptr, cache_ptr, page_base, slot_off, valid, bounds_ptr,
    values_ptr, head, tok, CALIBRATED: tl.constexpr,
    BITS: tl.constexpr, CODE_BYTES: tl.constexpr, CODE_OFF: tl.constexpr, NORM_OFF: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # x (calibrated keys: the shorter of (k - mean) / scale and k / scale) @ R.T in fp32
    row_base = (tok * stride_t + head * stride_h)[:, None]
    center = valid
    if CALIBRATED:
        center = center_keys(src_ptr, row_base, valid, mean_ptr, scale_ptr, head * HEAD_DIM, HEAD_DIM, D_PAD,
                             BLOCK_T, BLOCK_K)
    rotated, sq = rotate_rows(src_ptr, row_base, valid, rot_ptr, mean_ptr, scale_ptr, head * HEAD_DIM, center,
                              1 if CALIBRATED else 0, HEAD_DIM, D_PAD, BLOCK_T, BLOCK_K, INTERPRET)
    norm = tl.sqrt(sq)
    dims = tl.arange(0, D_PAD)
    d_ok = valid[:, None] & (dims[None, :] < HEAD_DIM)
    y = rotated / tl.where(norm > 0, norm, 1.0)[:, None]  # a zero vector keeps y = 0
    # Sign-magnitude code: top bit = sign, low bits = number of magnitude boundaries below |y|.
    mag = tl.zeros((BLOCK_T, D_PAD), dtype=tl.int32)
    for i in tl.static_range((1 << (BITS - 1)) - 1):
        mag += (tl.abs(y) > tl.load(bounds_ptr + i)).to(tl.int32)
    code = ((y < 0).to(tl.int32) << (BITS - 1)) | mag
    # Norm correction (see core.quantizer): the stored norm gives the reconstruction the exact norm.
    recon = tl.where(d_ok, tl.load(values_ptr + code), 0.0)
    norm = norm / tl.sqrt(tl.maximum(tl.sum(recon * recon, axis=1), 1e-30))  # skipped rows: any finite value
    if CALIBRATED:  # an uncentered key: its norm negated, floored so that a zero key stays marked
        norm = tl.where(center, norm, -tl.maximum(norm, _UNCENTERED_FLOOR))
    base = page_base + CODE_OFF + slot_off * CODE_BYTES  # (BLOCK_T,)
    # Two planes for 3 and 5 bits: the low BITS - 1 bits, then the sign bit; 2- and 3-bit planes byte-sliced
    # (core.packing.SLICED).
    if BITS == 3 or BITS == 5:
        LOW: tl.constexpr = BITS - 1
        _store_plane(cache_ptr, base, valid, code & ((1 << LOW) - 1), 0, LOW, BITS == 3, HEAD_DIM, D_PAD, BLOCK_T)
        _store_plane(cache_ptr, base, valid, code >> LOW, HEAD_DIM * LOW // 8, 1, False, HEAD_DIM, D_PAD, BLOCK_T)
    else:
        _store_plane(cache_ptr, base, valid, code, 0, BITS, BITS == 2, HEAD_DIM, D_PAD, BLOCK_T)
    norm_ptr = (cache_ptr + page_base + NORM_OFF + slot_off * 4).to(tl.pointer_type(tl.float32))
    tl.store(norm_ptr, norm, mask=valid)


# Token counts change with every batch: no recompiles mid-serving.
@triton.jit(do_not_specialize=["num_tokens", "num_query_tokens"])
def _store_kv_kernel(
    key_ptr, value_ptr, rot_ptr, mean_ptr, scale_ptr, cache_ptr, slot_ptr, k_bounds_ptr, v_bounds_ptr, k_values_ptr,
    v_values_ptr, num_tokens, stride_kt, stride_kh, stride_vt, stride_vh, stride_cblock, stride_chead,
    q_ptr, q_out_ptr, q_offset_ptr, num_query_tokens, stride_qt, stride_qh, q_scale,
    CALIBRATED: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_SIZE: tl.constexpr, K_BITS: tl.constexpr,
    V_BITS: tl.constexpr, K_CODE_BYTES: tl.constexpr, V_CODE_BYTES: tl.constexpr,
    K_NORM_OFF: tl.constexpr, V_CODE_OFF: tl.constexpr, V_NORM_OFF: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Grid axis 2: 0 stores the keys of KV head program_id(1), 1 its values, 2 + g rotates its query head g
    (of GROUP) for the first num_query_tokens tokens into q_out (contiguous (tokens, q heads, d)), and under the key
    calibration writes their offsets (q.mean * q_scale, (tokens, q heads) fp32) into q_offset."""
    head = tl.program_id(1)
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    part = tl.program_id(2)
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    valid = slot >= 0
    safe = tl.where(valid, slot, 0)
    page_base = (safe // BLOCK_SIZE) * stride_cblock + head * stride_chead
    slot_off = safe % BLOCK_SIZE
    if part == 0:
        _quantize_and_store(key_ptr, stride_kt, stride_kh, rot_ptr, mean_ptr, scale_ptr, cache_ptr, page_base,
                            slot_off, valid, k_bounds_ptr, k_values_ptr, head, tok, CALIBRATED, K_BITS, K_CODE_BYTES,
                            0, K_NORM_OFF, HEAD_DIM, D_PAD, BLOCK_T, BLOCK_K, INTERPRET)
    elif part == 1:
        _quantize_and_store(value_ptr, stride_vt, stride_vh, rot_ptr, mean_ptr, scale_ptr, cache_ptr, page_base,
                            slot_off, valid, v_bounds_ptr, v_values_ptr, head, tok, False, V_BITS, V_CODE_BYTES,
                            V_CODE_OFF, V_NORM_OFF, HEAD_DIM, D_PAD, BLOCK_T, BLOCK_K, INTERPRET)
    elif tl.program_id(0) * BLOCK_T < num_query_tokens:  # queries are a prefix of the tokens (the decodes)
        q_head = head * GROUP + part - 2
        q_ok = tok < num_query_tokens
        rotated, offset = rotate_rows(q_ptr, (tok * stride_qt + q_head * stride_qh)[:, None], q_ok, rot_ptr,
                                      mean_ptr, scale_ptr, head * HEAD_DIM, q_ok, 2 if CALIBRATED else 0, HEAD_DIM,
                                      D_PAD, BLOCK_T, BLOCK_K, INTERPRET)
        j = tl.arange(0, D_PAD)[None, :]
        out = round_to(rotated * q_scale, q_out_ptr.dtype.element_ty, INTERPRET)
        q_row = tok * (GROUP * tl.num_programs(1)) + q_head
        tl.store(q_out_ptr + q_row[:, None] * HEAD_DIM + j, out, mask=q_ok[:, None] & (j < HEAD_DIM))
        if CALIBRATED:
            tl.store(q_offset_ptr + q_row, offset * q_scale, mask=q_ok)


def store_block_tokens(num_tokens: int, head_dim: int) -> int:
    """Tokens per program: 16 keep a decode step's few tokens spread over many programs; prefill-sized batches take
    more, so each program reads R (d x d fp32) once for more tokens: 64, or 32 above head_dim 128, where 64 spill 3 KB
    a thread and ran 1.25x slower."""
    if num_tokens < STORE_LARGE_BATCH:
        return 16
    return 64 if head_dim <= 128 else 32


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, layout: CacheLayout,
    key_calibration: KeyCalibration | None = None, block_t: int | None = None, num_warps: int = 8,
    query: torch.Tensor | None = None, query_scale: float = 1.0, validate: bool = True,
) -> RotatedQuery | None:
    """Quantize key/value (tokens, kv_heads, head_dim) into their slots of the paged cache (-1: skip);
    with a key calibration, per token the shorter of (key - mean) / scale and key / scale, the latter with a
    negated norm (see core.calibration). block_t: tokens per program (None: store_block_tokens). query (tokens <=
    key's, q_heads, head_dim): also rotate it in the same launch and return what
    rotation.rotate_queries(query, layout, query_scale, key_calibration) returns (fp16), for
    paged_attention(rotated_query=...); None without a query. validate=False: the caller has checked kv_cache
    against layout already (the vLLM backend, once per forward)."""
    expected = (key.shape[0], layout.num_kv_heads, layout.head_dim)
    if tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(f"key and value must have shape {expected}, got {tuple(key.shape)} and {tuple(value.shape)}")
    check_dtype("key", key)
    check_dtype("value", value)
    if validate:
        check_cache(kv_cache, layout)
    check_index("slot_mapping", slot_mapping, key, (torch.int64, torch.int32))
    if slot_mapping.shape[0] < key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key and value must be contiguous in head_dim")
    num_tokens = key.shape[0]
    q_rot = q_offset = None
    if query is not None:
        check_dtype("query", query)
        if query.dim() != 3 or query.shape[0] > num_tokens or query.shape[2] != layout.head_dim \
                or query.shape[1] % layout.num_kv_heads or query.stride(2) != 1:
            raise ValueError(f"query must be (<= {num_tokens}, a multiple of {layout.num_kv_heads}, "
                             f"{layout.head_dim}), contiguous in head_dim, got {tuple(query.shape)}")
        q_rot = torch.empty(query.shape, dtype=torch.float16, device=query.device)
        if key_calibration is not None:
            q_offset = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    rotated = None if q_rot is None else RotatedQuery(q_rot, q_offset)
    if num_tokens == 0:
        return rotated
    if key_calibration is not None:
        check_calibration(key_calibration, layout)
    c = kernel_constants(layout, key.device)
    mean, scale = (key_calibration.mean, key_calibration.scale) if key_calibration else (c.rotation, c.rotation)
    block_t = block_t or store_block_tokens(num_tokens, layout.head_dim)
    group = 0 if query is None else query.shape[1] // layout.num_kv_heads
    q_in = key if query is None else query  # any valid pointer when there is no query
    grid = (triton.cdiv(num_tokens, block_t), layout.num_kv_heads, 2 + group)
    _store_kv_kernel[grid](
        key, value, c.rotation, mean, scale, kv_cache, slot_mapping, c.key_boundaries, c.value_boundaries,
        c.key_values[torch.float32], c.value_values[torch.float32],
        num_tokens, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), q_in, key if q_rot is None else q_rot,
        key if q_offset is None else q_offset,
        0 if query is None else query.shape[0], q_in.stride(0), q_in.stride(1), float(query_scale),
        CALIBRATED=key_calibration is not None, GROUP=max(group, 1), BLOCK_T=block_t, BLOCK_K=32,
        **page_constants(layout), INTERPRET=INTERPRETED,
        num_warps=num_warps,  # 8: 4 spill the 3xTF32 operands of the rotation
    )
    return rotated
