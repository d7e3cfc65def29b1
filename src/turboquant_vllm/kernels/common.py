"""Pieces shared by the Triton kernels: code planes and launch checks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def plane_bytes_to_codes(packed, ROWS: tl.constexpr, PLANE_BYTES: tl.constexpr, WIDTH: tl.constexpr):
    """(ROWS, PLANE_BYTES) uint8 -> (ROWS, PLANE_BYTES * 8 / WIDTH) int32 codes, natural order."""
    PER_BYTE: tl.constexpr = 8 // WIDTH
    shifts = tl.arange(0, PER_BYTE) * WIDTH
    codes = (packed.to(tl.int32)[:, :, None] >> shifts[None, None, :]) & ((1 << WIDTH) - 1)
    return tl.reshape(codes, (ROWS, PLANE_BYTES * PER_BYTE))


@triton.jit
def codes_to_plane_bytes(codes, ROWS: tl.constexpr, DIM: tl.constexpr, WIDTH: tl.constexpr):
    """(ROWS, DIM) int32 codes < 2^WIDTH -> (ROWS, DIM * WIDTH / 8) uint8, natural order."""
    PER_BYTE: tl.constexpr = 8 // WIDTH
    shifts = tl.arange(0, PER_BYTE) * WIDTH
    grouped = tl.reshape(codes, (ROWS, DIM // PER_BYTE, PER_BYTE)) << shifts[None, None, :]
    return tl.sum(grouped, axis=2).to(tl.uint8)


def check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} must be float16 or bfloat16, got {t.dtype}")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
