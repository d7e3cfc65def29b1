"""Quartet II's NVFP4 quantizer (the 4/6 rule) as one Triton kernel: x (M, K) -> packed E2M1 codes, E4M3 group
scales and fp32 tensor scales, bit for bit what naive.quantize_reference (nvfp4.four_six.quantize, packed) gives.
quantize_weight and quantize_parts quantize a linear layer's weight with it (one tensor scale, or one per fused part).

Weights take one tensor scale (given, amax / 1536 of the whole weight); activations one per row, computed in the
kernel from the row's amax, so a row's codes never depend on the other rows of its batch. Every division is
IEEE-exact (div_rn), the E4M3 and E2M1 roundings are to nearest, ties to even, done in fp32 arithmetic, and a group's
squared error is summed as a tree of pairs, as the reference does: the 4-or-6 choice agrees even on near-ties.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import nvfp4
from ...nvfp4 import NVFP4Weight

MIN_PROGRAMS = 256  # programs a launch aims for where rows are few (each then reads its rows' amax in full)
_RNE_MAGIC = tl.constexpr(8388608.0)  # 2^23: (v + 2^23) - 2^23 rounds 0 <= v < 2^22 to an integer, ties to even


@triton.jit
def _e4m3_round(s):
    """fp32 s in [0, 448] -> the nearest E4M3 value (ties to even) as fp32: 3 mantissa bits from 2^-6 up, steps of
    2^-9 below (subnormals)."""
    exponent = ((s.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)
    quantum = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3), exactly
    return ((tl.math.div_rn(s, quantum) + _RNE_MAGIC) - _RNE_MAGIC) * quantum


@triton.jit
def _e2m1(y):
    """fp32 y -> (E2M1 code: sign << 3 | magnitude index, its fp32 value), nearest, ties to even, clipped to 6."""
    a = tl.abs(y)
    index = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
             + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    # E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: half-steps up to 2, then steps of 1, then 6
    value = tl.where(index <= 4, index * 0.5, tl.where(index == 7, 6.0, index - 2.0))
    negative = (y < 0) & (index > 0)  # -0 is stored as 0
    return index | (negative.to(tl.int32) << 3), tl.where(negative, -value, value)


@triton.jit
def _pairwise_sum16(v, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """(BLOCK_M, BLOCK_G, 16) -> (BLOCK_M, BLOCK_G): ((v0 + v1) + (v2 + v3)) + ..., as nvfp4.pairwise_sum."""
    v = tl.sum(tl.reshape(v, (BLOCK_M, BLOCK_G, 8, 2)), axis=3)
    v = tl.sum(tl.reshape(v, (BLOCK_M, BLOCK_G, 4, 2)), axis=3)
    v = tl.sum(tl.reshape(v, (BLOCK_M, BLOCK_G, 2, 2)), axis=3)
    return tl.sum(v, axis=2)


@triton.jit
def _candidate(x, units, gmax, ts, INV_TARGET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """The groups quantized with their max mapped to 1 / INV_TARGET: (codes, E4M3 scales, squared errors in units of
    the tensor scale)."""
    scale = _e4m3_round(tl.math.div_rn(gmax * INV_TARGET, ts[:, None]))
    code, value = _e2m1(tl.math.div_rn(x, (tl.where(scale > 0, scale, 1.0) * ts[:, None])[:, :, None]))
    d = value * scale[:, :, None] - units
    return code, scale, _pairwise_sum16(d * d, BLOCK_M, BLOCK_G)


@triton.jit(do_not_specialize=["M", "groups_per_program"])
def _nvfp4_quantize_kernel(
    x_ptr, ts_ptr, packed_ptr, scales_ptr, M, K: tl.constexpr, stride_xm, groups_per_program,
    PER_ROW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64) * stride_xm
    if PER_ROW:  # the row's amax first (every program of the row alike), then its groups
        amax = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, K, BLOCK_G * 16):
            cols = k0 + tl.arange(0, BLOCK_G * 16)
            x = tl.load(x_rows[:, None] + cols[None, :], mask=row_ok[:, None] & (cols[None, :] < K), other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        ts = amax * (1.0 / 256.0) * (1.0 / 6.0)  # Quartet II's order: (amax * 1/256) * fp32(1/6)
        ts = tl.where(amax > 0, ts, 1.0)
        tl.store(ts_ptr + rows, ts, mask=row_ok & (tl.program_id(1) == 0))
    else:
        ts = tl.zeros((BLOCK_M,), tl.float32) + tl.load(ts_ptr)
    ts3 = ts[:, None, None]
    g = tl.arange(0, BLOCK_G)
    e = tl.arange(0, 16)
    first = tl.program_id(1) * groups_per_program
    for g0 in range(first, first + groups_per_program, BLOCK_G):
        groups = g0 + g
        ok = row_ok[:, None] & (groups[None, :] < K // 16)
        cols = groups[:, None] * 16 + e[None, :]
        x = tl.load(x_rows[:, None, None] + cols[None, :, :], mask=ok[:, :, None], other=0.0).to(tl.float32)
        gmax = tl.max(tl.abs(x), axis=2)
        units = tl.math.div_rn(x, ts3)
        # the max of each group mapped to 6 (E2M1's whole range), then to 4 (finer steps, the top clipped to 6)
        code6, scale6, err6 = _candidate(x, units, gmax, ts, 1.0 / 6.0, BLOCK_M, BLOCK_G)
        code4, scale4, err4 = _candidate(x, units, gmax, ts, 0.25, BLOCK_M, BLOCK_G)
        four = err4 < err6  # a tie keeps 6
        code = tl.where(four[:, :, None], code4, code6)
        scale = tl.where(four, scale4, scale6)
        lo, hi = tl.split(tl.reshape(code, (BLOCK_M, BLOCK_G, 8, 2)))
        byte = (lo | (hi << 4)).to(tl.uint8)
        b = tl.arange(0, 8)
        row_bytes = packed_ptr + rows[:, None, None].to(tl.int64) * (K // 2)
        tl.store(row_bytes + groups[None, :, None] * 8 + b[None, None, :], byte, mask=ok[:, :, None])
        tl.store(scales_ptr + rows[:, None].to(tl.int64) * (K // 16) + groups[None, :],
                 scale.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=ok)


def quantize(x: torch.Tensor, tensor_scale: torch.Tensor | None = None, per_row: bool = False,
             packed: torch.Tensor | None = None, scales: torch.Tensor | None = None, block_m: int = 16,
             block_g: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) bf16 / fp16 / fp32, K a multiple of 16 -> (packed codes uint8 (M, K / 2), element 2i in the low
    nibble; E4M3 scales (M, K / 16); fp32 tensor scale: tensor_scale as given (a scalar), else per_row (M, 1) from
    each row's amax, else the whole tensor's (a scalar)); packed / scales: written in place if given.
    naive.quantize_reference is the reference."""
    if x.dim() != 2 or x.shape[1] % nvfp4.GROUP:
        raise ValueError(f"NVFP4 quantizes (M, K) with K a multiple of {nvfp4.GROUP}, got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.stride(1) != 1:
        raise ValueError(f"x must be bf16, fp16 or fp32 and contiguous along K, got {x.dtype}, strides {x.stride()}")
    # checked where it can be: a compiled or graph-captured forward cannot branch on data (nor sync to)
    checkable = not torch.compiler.is_compiling() and not (x.is_cuda and torch.cuda.is_current_stream_capturing())
    if checkable and not torch.isfinite(x).all():
        raise ValueError("NVFP4 input holds NaN or inf: the tensor scale (amax / 1536) would be undefined")
    m, k = x.shape
    if tensor_scale is not None:
        ts = torch.as_tensor(tensor_scale, dtype=torch.float32, device=x.device).reshape(1).contiguous()
    elif per_row:
        ts = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    else:
        ts = nvfp4.tensor_scale_of(x).reshape(1).contiguous()
    if packed is None:
        packed = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    if scales is None:
        scales = torch.empty((m, k // nvfp4.GROUP), dtype=torch.float8_e4m3fn, device=x.device)
    for name, t, shape, dtype in (("packed", packed, (m, k // 2), torch.uint8),
                                  ("scales", scales, (m, k // nvfp4.GROUP), torch.float8_e4m3fn)):
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != x.device:
            raise ValueError(f"{name} must be contiguous {dtype} {shape} on {x.device}, got {t.dtype} "
                             f"{tuple(t.shape)}")
    if m:
        row_blocks, group_blocks = triton.cdiv(m, block_m), triton.cdiv(k // nvfp4.GROUP, block_g)
        # a few rows (decode steps) would leave the GPU one program looping over K: split K across programs
        per_program = block_g * triton.cdiv(group_blocks, min(group_blocks, triton.cdiv(MIN_PROGRAMS, row_blocks)))
        _nvfp4_quantize_kernel[(row_blocks, triton.cdiv(k // nvfp4.GROUP, per_program))](
            x, ts, packed, scales.view(torch.uint8), m, K=k, stride_xm=x.stride(0), groups_per_program=per_program,
            PER_ROW=tensor_scale is None and per_row, BLOCK_M=block_m, BLOCK_G=block_g,
        )
    return packed, scales, ts if per_row and tensor_scale is None else ts.reshape(())


def quantize_weight(weight: torch.Tensor) -> NVFP4Weight:
    """nn.Linear's weight (N, K) -> NVFP4 with one tensor scale: K / 2 + K / 16 bytes a row instead of 2 K (bf16)."""
    packed, scales, ts = quantize(weight.contiguous())
    return NVFP4Weight(packed, scales, ts)


def quantize_parts(weight: torch.Tensor, parts: list[int]) -> NVFP4Weight:
    """A fused layer's weight (its parts' rows stacked, e.g. q / k / v) -> NVFP4 with one tensor scale per part, as
    the model's own linears (and their NVFP4 checkpoints) are quantized: the tensor scale repeated over each part's
    rows. One part: quantize_weight."""
    if len(parts) <= 1:
        return quantize_weight(weight)
    pieces = [quantize_weight(w) for w in weight.split(parts, dim=0)]
    rows = torch.cat([q.tensor_scale.reshape(1).expand(n) for q, n in zip(pieces, parts)])
    return NVFP4Weight(torch.cat([q.packed for q in pieces]), torch.cat([q.scales for q in pieces]), rows)
