"""The few-token kernel's arithmetic in plain PyTorch (CPU or GPU), bit for bit: the same bit operations on the same
Marlin words, the same sums in the same order (each mma's 16 products summed exactly and rounded once to fp32, as far
as the tensor core's own rounding allows).

kernels.marlin_mma.gemm is tested against emulate on the GPU; emulate against the W4A16 reference
(kernels.marlin.naive) on the CPU.
"""

from __future__ import annotations

import torch

from ..marlin_layout import TILE_K, TILE_N

WARPS = 4  # a CTA's warps, each every fourth k-tile of the CTA's range

FRAGMENT_SHIFT = {torch.bfloat16: 8, torch.float16: 7}  # decoded code x scale = value x 2^-shift: alpha x 2^shift


def decode_words(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint32 words (int64) (...) -> the A fragment's 4 registers (..., 4) as uint32 (int64): decode_word (register r
    holds nibbles (j, j + 4), j = 0, 2, 1, 3)."""
    bf16 = dtype == torch.bfloat16
    mag_mask = 0x01C001C0 if bf16 else 0x0E000E00
    out = []
    for j in (0, 2, 1, 3):
        shift = (6 if bf16 else 9) - 4 * j
        mag = ((w << shift) if shift >= 0 else (w >> -shift)) & mag_mask
        out.append(mag | ((w << (12 - 4 * j)) & 0x80008000))
    return torch.stack(out, dim=-1)


def scale_dup(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A scale byte in both 16-bit lanes (int64) -> the 16-bit floats' bits the decoded codes are multiplied by."""
    if dtype == torch.bfloat16:
        return ((p << 4) + 0x6F806F80) & 0xFFFFFFFF
    return (p << 7) & 0xFFFFFFFF


def lane_scale_bytes(sb: torch.Tensor) -> torch.Tensor:
    """A lane's 8 scale bytes (..., 8), as its group g loads them -> (..., n54, n3): the byte of row
    16 n54 + g + 8 n3 sits at (n54 >> 1) * 4 + n3 * 2 + (n54 & 1)."""
    q = torch.tensor([[(n54 >> 1) * 4 + n3 * 2 + (n54 & 1) for n3 in (0, 1)] for n54 in range(4)], device=sb.device)
    return sb[..., q]


def halves(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint32 (int64) (...) -> its two 16-bit floats (..., 2) in fp32, the low half first."""
    bits = torch.stack([v & 0xFFFF, v >> 16], dim=-1).to(torch.int32).to(torch.int16)
    return bits.view(dtype).to(torch.float32)


def decoded_weight(codes: torch.Tensor, scale_bytes: torch.Tensor, n: int, k: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """The weight (n, k) in fp32 as the kernel's A fragments hold it after the scale multiply (mul2): the NVFP4 value
    x 2^-FRAGMENT_SHIFT, placed by the fragment layout: lane g * 4 + t, register r, half h -> n = 16 n54 + g +
    8 (r & 1), k = 2 t + h + 8 (r >> 1). Flushed groups must have had their codes zeroed (zero_flushed_codes)."""
    padded_n = scale_bytes.shape[1]
    k_tiles, n_tiles = k // TILE_K, padded_n // TILE_N
    # Marlin pads K as well: the rows past k's tiles hold zeros, and the kernel never reads them
    w = codes.reshape(-1, n_tiles, 8, 4, 4)[:k_tiles].to(torch.int64) & 0xFFFFFFFF  # (kt, tile, g, t, n54)
    a = halves(decode_words(w, dtype), dtype)  # (kt, tile, g, t, n54, r, h)
    sb = scale_bytes.view(torch.uint8)[:k_tiles].to(torch.int64).reshape(k_tiles, n_tiles, 8, 8)  # (kt, tile, g, byte)
    byte = lane_scale_bytes(sb)  # (kt, tile, g, n54, n3)
    s = halves(scale_dup(byte | byte << 16, dtype), dtype)[..., 0]  # both lanes alike
    s = s[:, :, :, None, :, None, None, :].expand(-1, -1, -1, 4, -1, 2, 2, -1)  # (kt, tile, g, t, n54, r>>1, h, n3)
    s = s.permute(0, 1, 2, 3, 4, 5, 7, 6).reshape(k_tiles, n_tiles, 8, 4, 4, 4, 2)  # r = (r >> 1) * 2 + n3
    a = (a * s).to(dtype).to(torch.float32)  # mul2: exact, rounded as the kernel rounds
    # (kt, tile, g, t, n54, r>>1 (k3), n3, h) -> (tile, n54, n3, g, kt, k3, t, h) = (n, k)
    a = a.reshape(k_tiles, n_tiles, 8, 4, 4, 2, 2, 2).permute(1, 4, 6, 2, 0, 5, 3, 7)
    return a.reshape(padded_n, k)[:n]


def emulate(x: torch.Tensor, codes: torch.Tensor, scale_bytes: torch.Tensor, n: int, k: int, alpha: float,
            splits: int, per: int) -> torch.Tensor:
    """The kernel's result in plain PyTorch (CPU or GPU): x (M <= 8, K), `splits` of `per` k-tiles each."""
    w = decoded_weight(codes, scale_bytes, n, k, x.dtype).to(x.device)
    xf = x.to(torch.float32)
    total = None
    for sp in range(splits):
        tiles = range(sp * per, min((sp + 1) * per, k // TILE_K))
        cta = None
        for warp in range(WARPS):
            acc = torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device)
            for kt in tiles[warp::WARPS]:
                sl = slice(kt * TILE_K, (kt + 1) * TILE_K)
                acc = acc + (xf[:, sl].double() @ w[:, sl].double().t()).float()
            cta = acc if cta is None else cta + acc
        total = cta if total is None else total + cta
    return (alpha * 2.0 ** FRAGMENT_SHIFT[x.dtype] * total).to(x.dtype)
