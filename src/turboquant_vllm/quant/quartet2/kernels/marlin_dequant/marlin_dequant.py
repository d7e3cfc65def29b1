"""The marlin path's large-batch GEMM: Marlin's NVFP4 weight read back into bf16 / fp16 values, then one dense matmul.

Marlin runs on mma.sync: from a few hundred tokens on it takes about twice cuBLAS's time for the same GEMM, while
writing the weight out as 16-bit values costs one pass over it (`nvfp4_gemm/h100-cloverlm-4b.md`). So above
DENSE_MIN_TOKENS tokens the layer decodes its Marlin-layout weight into a scratch buffer shared by all layers and
multiplies with cuBLAS; the weight stays stored once, in Marlin's layout.

The decoder reads Marlin's layout as kernels.marlin_layout states it (tile_layout). The decoded value is
code * fp16(byte << 7) * 2^-7 = code * scale * factor (factor: the power of two vLLM lifts a bf16 layer's scales by,
1 for fp16), exact in bf16 and fp16 (at most 6 significant bits; fp16: at most 6 * 448): the tensor scale / factor is
the matmul's alpha, applied by cuBLAS to its fp32 sums before the one rounding, as Marlin applies its global scale.
Groups Marlin flushed to zero decode to zero. naive.dequantize_reference is the decoder's reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dequantize.dequantize import e2m1_value
from ..marlin_layout import TILE_K, TILE_N

DENSE_MIN_TOKENS = 512  # from here on decode + cuBLAS beats Marlin on every measured layer (the GEMM table above)
DECODE_K_TILES = 16  # k-tiles a decoder program takes (with one 64-column tile)


@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, out_ptr, N, K, padded_n, KT: tl.constexpr):
    """One 64-column tile by KT k-tiles: its words and scale bytes read in Marlin's order (contiguous), decoded, and
    put in (n, k) order by reshapes (tile_layout's bit fields as axes), one permute each."""
    ntile = tl.program_id(0)
    kt = tl.program_id(1) * KT + tl.arange(0, KT)
    kt_ok = kt < K // 16
    row = kt.to(tl.int64)[:, None]
    words = tl.load(codes_ptr + row * (2 * padded_n) + ntile * 128 + tl.arange(0, 128)[None, :], mask=kt_ok[:, None],
                    other=0)
    code = (words[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :]) & 15  # (kt, word, nibble)
    # (kt, n_lo, k21, n54, k0, n3, k3) -> (n54, n3, n_lo, kt, k3, k21, k0) = (n, k)
    value = tl.reshape(tl.permute(tl.reshape(e2m1_value(code), (KT, 8, 4, 4, 2, 2, 2)), (3, 5, 1, 0, 6, 2, 4)),
                       (64, KT, 16))
    byte = tl.load(scales_ptr + row * padded_n + ntile * 64 + tl.arange(0, 64)[None, :], mask=kt_ok[:, None],
                   other=0)
    scale = (byte.to(tl.int16) << 7).to(tl.float16, bitcast=True).to(tl.float32) * 0.0078125  # 2^-7: the byte's 2^7
    # (kt, n_lo, n54 >> 1, n3, n54 & 1) -> (n54 >> 1, n54 & 1, n3, n_lo, kt) = (n, kt)
    scale = tl.reshape(tl.permute(tl.reshape(scale, (KT, 8, 2, 2, 2)), (2, 4, 3, 1, 0)), (64, KT))
    w = tl.reshape(value * scale[:, :, None], (64, KT * 16))
    n = ntile * 64 + tl.arange(0, 64)
    k = tl.program_id(1) * KT * 16 + tl.arange(0, KT * 16)
    tl.store(out_ptr + n.to(tl.int64)[:, None] * K + k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=(n[:, None] < N) & (k[None, :] < K))


def dequantize(codes: torch.Tensor, scale_bytes: torch.Tensor, n: int, k: int, out: torch.Tensor) -> torch.Tensor:
    """out[:n * k] viewed (n, k) <- code * fp16(byte << 7) * 2^-7 in out's dtype (exact): the Triton decoder, for
    Marlin's layout as marlin_layout.tile_layout() states it (marlin_layout.tables() checks vLLM's against it)."""
    w = out[:n * k].view(n, k)
    grid = (triton.cdiv(n, TILE_N), triton.cdiv(k // TILE_K, DECODE_K_TILES))
    _dequantize_kernel[grid](codes, scale_bytes.view(torch.uint8), w, n, k, scale_bytes.shape[1], KT=DECODE_K_TILES)
    return w


_SCRATCH: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def reserve_scratch(numel: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The decoded weights' buffer, one per device and dtype shared by every layer, grown to `numel` (at load time,
    so that vLLM's memory profile sees it and no CUDA graph captures an allocation)."""
    key = (torch.device(device), dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        _SCRATCH[key] = buf = torch.empty(numel, dtype=dtype, device=device)
    return buf


def dense_linear(x: torch.Tensor, codes: torch.Tensor, scale_bytes: torch.Tensor, n: int, k: int,
                 alpha: float) -> torch.Tensor:
    """alpha * x W^T for x (M, K) with W decoded from Marlin's layout into the shared scratch, one cuBLAS call: its
    fp32 sums scaled by alpha and rounded once to x's dtype."""
    w = dequantize(codes, scale_bytes, n, k, reserve_scratch(n * k, x.device, x.dtype))
    return torch.addmm(x.new_zeros(()), x, w.t(), beta=0, alpha=alpha)
