"""Store kernel: rotate, normalize, quantize and pack new keys/values into the paged cache.

Reference: turboquant_vllm.core.reference.store_kv_reference (bit-exact up to fp32 rounding of
the rotation). One launch writes K and V: grid axis 2 picks which.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.layout import CacheLayout
from .common import check_dtype, codes_to_plane_bytes, next_pow2
from .constants import kernel_constants


@triton.jit
def _store_plane(cache_ptr, base, valid, code, chunk, PLANE_START: tl.constexpr, WIDTH: tl.constexpr,
                 HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr):
    """Pack one chunk of CHUNK coordinates' codes (< 2^WIDTH) and store them at their bytes of the plane."""
    packed = codes_to_plane_bytes(code, BLOCK_T, CHUNK, WIDTH)
    j = tl.arange(0, CHUNK * WIDTH // 8)
    first = chunk * CHUNK * WIDTH // 8 + j  # byte index within the plane
    tl.store(cache_ptr + base[:, None] + PLANE_START + first[None, :], packed,
             mask=valid[:, None] & (first[None, :] < HEAD_DIM * WIDTH // 8))


@triton.jit
def _quantize_and_store(
    src_ptr, stride_t, stride_h, cache_ptr, page_base, slot_off, valid, rot_ptr, bounds_ptr, head, tok,
    BITS: tl.constexpr, CODE_BYTES: tl.constexpr, CODE_OFF: tl.constexpr, NORM_OFF: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):
    dims = tl.arange(0, D_PAD)
    x = tl.load(src_ptr + tok[:, None] * stride_t + head * stride_h + dims[None, :],
                mask=valid[:, None] & (dims[None, :] < HEAD_DIM), other=0.0).to(tl.float32)
    norm = tl.sqrt(tl.sum(x * x, axis=1))
    inv = tl.where(norm > 0, norm, 1.0)[:, None]  # a zero vector keeps y = 0
    base = page_base + CODE_OFF + slot_off * CODE_BYTES  # (BLOCK_T,)
    # Rotate 32 output coordinates at a time: a (D_PAD, 32) slice of R^T stays in registers.
    CHUNK: tl.constexpr = 32
    for chunk in tl.static_range(D_PAD // CHUNK):
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        # rot_t[i, j] = R[j, i], so x @ rot_t = (R x) for row vectors x
        rot_t = tl.load(rot_ptr + cols[None, :] * HEAD_DIM + dims[:, None],
                        mask=(dims[:, None] < HEAD_DIM) & (cols[None, :] < HEAD_DIM), other=0.0)
        y = tl.dot(x, rot_t, input_precision="ieee") / inv
        # Sign-magnitude code: top bit = sign, low bits = number of magnitude boundaries below |y|.
        mag = tl.zeros((BLOCK_T, CHUNK), dtype=tl.int32)
        for i in tl.static_range((1 << (BITS - 1)) - 1):
            mag += (tl.abs(y) > tl.load(bounds_ptr + i)).to(tl.int32)
        code = ((y < 0).to(tl.int32) << (BITS - 1)) | mag
        if BITS == 3:  # two planes: low 2 bits, then the sign bit (see core.packing)
            _store_plane(cache_ptr, base, valid, code & 3, chunk, 0, 2, HEAD_DIM, CHUNK, BLOCK_T)
            _store_plane(cache_ptr, base, valid, code >> 2, chunk, HEAD_DIM // 4, 1, HEAD_DIM, CHUNK, BLOCK_T)
        else:
            _store_plane(cache_ptr, base, valid, code, chunk, 0, BITS, HEAD_DIM, CHUNK, BLOCK_T)
    norm_ptr = (cache_ptr + page_base + NORM_OFF + slot_off * 4).to(tl.pointer_type(tl.float32))
    tl.store(norm_ptr, norm, mask=valid)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr, rot_ptr, k_bounds_ptr, v_bounds_ptr,
    num_tokens, stride_kt, stride_kh, stride_vt, stride_vh, stride_cblock, stride_chead,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_CODE_BYTES: tl.constexpr, V_CODE_BYTES: tl.constexpr,
    K_NORM_OFF: tl.constexpr, V_CODE_OFF: tl.constexpr, V_NORM_OFF: tl.constexpr,
):
    head = tl.program_id(1)
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    valid = slot >= 0
    safe = tl.where(valid, slot, 0)
    page_base = (safe // BLOCK_SIZE) * stride_cblock + head * stride_chead
    slot_off = safe % BLOCK_SIZE
    if tl.program_id(2) == 0:
        _quantize_and_store(key_ptr, stride_kt, stride_kh, cache_ptr, page_base, slot_off, valid, rot_ptr,
                            k_bounds_ptr, head, tok, K_BITS, K_CODE_BYTES, 0, K_NORM_OFF, HEAD_DIM, D_PAD, BLOCK_T)
    else:
        _quantize_and_store(value_ptr, stride_vt, stride_vh, cache_ptr, page_base, slot_off, valid, rot_ptr,
                            v_bounds_ptr, head, tok, V_BITS, V_CODE_BYTES, V_CODE_OFF, V_NORM_OFF, HEAD_DIM, D_PAD,
                            BLOCK_T)


def check_cache(kv_cache: torch.Tensor, layout: CacheLayout) -> None:
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 3 or tuple(kv_cache.shape[1:]) != layout.cache_shape(0)[1:]:
        raise ValueError(
            f"kv_cache must be uint8 of shape (num_blocks, {layout.num_kv_heads}, {layout.head_page_bytes}) "
            f"for this layout, got {kv_cache.dtype} {tuple(kv_cache.shape)}"
        )
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != layout.head_page_bytes:
        raise ValueError("each block of kv_cache must be contiguous")


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, layout: CacheLayout
) -> None:
    """Quantize key/value (tokens, kv_heads, head_dim) into their slots of the paged cache (-1: skip)."""
    expected = (key.shape[0], layout.num_kv_heads, layout.head_dim)
    if tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(f"key and value must have shape {expected}, got {tuple(key.shape)} and {tuple(value.shape)}")
    check_dtype("key", key)
    check_dtype("value", value)
    check_cache(kv_cache, layout)
    if slot_mapping.shape[0] < key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key and value must be contiguous in head_dim")
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    c = kernel_constants(layout, key.device)
    block_t = 16  # small tiles: a decode step's few tokens still spread over many programs
    grid = (triton.cdiv(num_tokens, block_t), layout.num_kv_heads, 2)
    _store_kv_kernel[grid](
        key, value, kv_cache, slot_mapping, c.rotation, c.key_boundaries, c.value_boundaries,
        num_tokens, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        HEAD_DIM=layout.head_dim, D_PAD=next_pow2(layout.head_dim), BLOCK_T=block_t, BLOCK_SIZE=layout.block_size,
        K_BITS=layout.preset.k_bits, V_BITS=layout.preset.v_bits,
        K_CODE_BYTES=layout.key_code_bytes, V_CODE_BYTES=layout.value_code_bytes,
        K_NORM_OFF=layout.key_norm_offset, V_CODE_OFF=layout.value_code_offset, V_NORM_OFF=layout.value_norm_offset,
        num_warps=4,
    )
