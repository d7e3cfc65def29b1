"""vLLM's Marlin layout of an NVFP4 weight (what prepare_fp4_layer_for_marlin makes, vLLM 0.33), as the marlin path's
own kernels read it (marlin_dequant's decoder, marlin_mma's few-token GEMM):
  codes   int32 (padded_k / 16, 2 padded_n): each 16 (k) x 64 (n) tile of E2M1 codes is 128 consecutive words, tiles
          ordered by n within a row of k-tiles; where code (k, n) lies inside its tile (word, nibble) is a fixed
          permutation, read off gptq_marlin_repack itself by probing (weight_tables), not restated from its source.
  scales  uint8 (padded_k / 16, padded_n): per 64 columns a fixed permutation (scale_columns, probed the same way);
          each byte is the top byte of fp16(scale * factor * 2^7) << 1 (S0E5M3), so fp16 bits = byte << 7 exactly
          (an E4M3 scale has 3 mantissa bits).
tile_layout() states the layout the kernels are written for; tables() probes vLLM's and refuses another.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

TILE_K, TILE_N = 16, 64  # Marlin's weight tile


class MarlinTables(NamedTuple):
    """Where Marlin keeps weight (k, n), by its place in a tile: int32 on the weight's device."""

    word: torch.Tensor  # (16, 64): the word within the tile's 128
    shift: torch.Tensor  # (16, 64): 4 x the nibble within the word
    scale_column: torch.Tensor  # (64,): column c of a 64-column block of scales sits at block start + scale_column[c]


def gptq_pack(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (K, N) -> GPTQ's int32 (K / 8, N): code (8 i + j, n) in nibble j of word (i, n), the input of
    gptq_marlin_repack (what prepare_fp4_layer_for_marlin makes of NVFP4's (N, K / 2) bytes)."""
    k, n = codes.shape
    c = codes.to(torch.int64).reshape(k // 8, 8, n)
    word = sum(c[:, j] << (4 * j) for j in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """int32 words (..., W) -> their nibbles (..., W, 8), nibble j = bits 4 j .. 4 j + 3."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(w >> (4 * j)) & 15 for j in range(8)], dim=-1)


def weight_tables(repack: Callable[[torch.Tensor, int, int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(word, shift) of every place (k, n) of a tile, probed through repack(gptq_codes, size_k, size_n) -> Marlin's
    int32 (size_k / 16, 2 size_n): three probes of a 128 x 128 weight whose codes are k % 16, n % 16 and n % 64 // 16.
    Every one of its 16 tiles must give the same places (the layout is the tile's permutation, repeated)."""
    k, n = torch.meshgrid(torch.arange(128), torch.arange(128), indexing="ij")
    seen = [unpack_words(repack(gptq_pack(c), 128, 128)).reshape(8, 2, 128 * 8)
            for c in (k % 16, n % 16, n % 64 // 16)]  # (k-tile, n-tile, place in the tile's words)
    k_in, n_lo, n_hi = seen
    if not all(torch.equal(s, s[:1, :1].expand_as(s)) for s in seen):
        raise RuntimeError("Marlin's weight layout is not one permutation per 16 x 64 tile: the dense GEMM path cannot "
                           "read it (set TURBOQUANT_QUARTET2_DENSE_MIN_TOKENS=0)")
    source = k_in[0, 0] * TILE_N + n_hi[0, 0] * 16 + n_lo[0, 0]  # place p holds weight (k_in, n_in)
    if not torch.equal(source.sort().values, torch.arange(TILE_K * TILE_N)):
        raise RuntimeError("Marlin's weight layout is not a permutation of its 16 x 64 tile")
    place = torch.empty_like(source)
    place[source] = torch.arange(source.numel())
    word, shift = place // 8, 4 * (place % 8)
    return word.reshape(TILE_K, TILE_N).to(torch.int32), shift.reshape(TILE_K, TILE_N).to(torch.int32)


def scale_columns(process: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """(64,): where each column of a 64-column block of scales lands, probed through process(scales (2, 128) fp16 of
    E4M3 values) -> Marlin's scale bytes (2, 128): the probe's 64 distinct values per block, found by their bytes."""
    codes = (0x38 + torch.arange(128) % 64).to(torch.uint8)  # E4M3 1.0 ... 240: 64 distinct normal values per block
    probe = codes.view(torch.float8_e4m3fn).to(torch.float16).expand(2, 128).contiguous()
    out = process(probe).view(torch.uint8).to(torch.int32)
    if out.shape != (2, 128) or not torch.equal(out, out[:1].expand_as(out)):
        raise RuntimeError(f"Marlin's scale layout: unexpected bytes of shape {tuple(out.shape)}")
    blocks = out[0].reshape(2, 64)
    if not torch.equal(blocks[0], blocks[1]) or blocks[0].unique().numel() != 64:
        raise RuntimeError("Marlin's scale layout is not one permutation per 64 columns")
    return blocks[0].argsort().to(torch.int32)  # the bytes grow with the values, the values with the column


def vllm_scale_process(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """What prepare_fp4_layer_for_marlin does to (K / 16, N) scales: vLLM's own permutation and byte format."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_permute_scales
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import nvfp4_marlin_process_scales

    def process(s: torch.Tensor) -> torch.Tensor:
        rows, n = s.shape
        permuted = marlin_permute_scales(s.to(dtype), size_k=rows * 16, size_n=n, group_size=16)
        return nvfp4_marlin_process_scales(permuted, a_dtype=dtype)[0]

    return process


@functools.cache
def tables(device: torch.device, dtype: torch.dtype) -> MarlinTables:
    """The tables for Marlin weights on `device` prepared for `dtype` activations, probed through vLLM's own
    gptq_marlin_repack and scale processing once per process."""
    from vllm import _custom_ops as ops

    def repack(q: torch.Tensor, size_k: int, size_n: int) -> torch.Tensor:
        return ops.gptq_marlin_repack(q.to(device), size_k, size_n, 4).cpu()

    word, shift = weight_tables(repack)
    t = MarlinTables(word, shift, scale_columns(vllm_scale_process(dtype)))
    if not all(torch.equal(a.cpu(), b) for a, b in zip(t, tile_layout())):
        raise RuntimeError("this vLLM's Marlin layout is not the one the NVFP4 decoder reads (tile_layout): run with "
                           "TURBOQUANT_QUARTET2_DENSE_MIN_TOKENS=0 (Marlin for every token count), or vllm 0.33")
    return MarlinTables(*(a.to(device) for a in t))


def tile_layout() -> MarlinTables:
    """The tables of the layout the decoder is written for (CPU): word n_lo * 16 + k21 * 4 + n54 holds, in nibble
    k0 * 4 + n3 * 2 + k3, the code of n = n_lo + 8 n3 + 16 n54, k = k0 + 2 k21 + 8 k3; the scale of column
    n_lo + 8 n3 + 16 n54 sits at 8 n_lo + (n54 >> 1) * 4 + n3 * 2 + (n54 & 1)."""
    k, n = torch.meshgrid(torch.arange(TILE_K), torch.arange(TILE_N), indexing="ij")
    k0, k21, k3 = k % 2, k // 2 % 4, k // 8
    n_lo, n3, n54 = n % 8, n // 8 % 2, n // 16
    word = n_lo * 16 + k21 * 4 + n54
    shift = 4 * (k0 * 4 + n3 * 2 + k3)
    c = torch.arange(TILE_N)
    column = 8 * (c % 8) + (c // 16 >> 1) * 4 + c // 8 % 2 * 2 + (c // 16 & 1)
    return MarlinTables(word.to(torch.int32), shift.to(torch.int32), column.to(torch.int32))
