"""AutoAWQ's GEMM checkpoint format in plain PyTorch: what every AWQ kernel path is checked against.

A linear layer y = x @ W of in_features K and out_features N, 4-bit codes in groups of `group_size` input rows:

    qweight  int32 (K, N / 8)   eight codes per word along N, column 8j + PACK_ORDER[i] at bits 4i .. 4i + 3
    qzeros   int32 (K / g, N / 8)  each group's zero point per column, packed the same way
    scales   fp16  (K / g, N)

    W[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]

(AutoAWQ interleaves the eight columns of a word as 0, 2, 4, 6, 1, 3, 5, 7 so that its kernels expand a word into
fp16 pairs with two shifts.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

BITS = 4
PACK = 32 // BITS  # codes per int32 word
PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column (of the word's eight) stored at bits 4i
MAX_CODE = (1 << BITS) - 1


class AWQWeight(NamedTuple):
    qweight: torch.Tensor  # int32 (K, N / 8)
    qzeros: torch.Tensor  # int32 (K / g, N / 8)
    scales: torch.Tensor  # fp16 (K / g, N)

    @property
    def group_size(self) -> int:
        return self.qweight.shape[0] // self.scales.shape[0]


def pack(codes: torch.Tensor) -> torch.Tensor:
    """(R, N) integer codes in [0, 15] -> (R, N / 8) int32 words in AWQ's column order."""
    rows, n = codes.shape
    if n % PACK:
        raise ValueError(f"AWQ packs {PACK} columns a word: {n} columns is not a multiple of {PACK}")
    if codes.numel() and (codes.min() < 0 or codes.max() > MAX_CODE):
        raise ValueError(f"codes must lie in [0, {MAX_CODE}]")
    grouped = codes.to(torch.int64).view(rows, n // PACK, PACK)[:, :, list(PACK_ORDER)]
    shifts = torch.arange(0, 32, BITS, dtype=torch.int64, device=codes.device)
    words = (grouped << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the top code sets the sign bit


def unpack(words: torch.Tensor) -> torch.Tensor:
    """(R, N / 8) int32 words in AWQ's column order -> (R, N) int32 codes."""
    if words.dtype != torch.int32:
        raise ValueError(f"AWQ words are int32, got {words.dtype}")
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32, device=words.device)
    fields = (words.unsqueeze(-1) >> shifts) & MAX_CODE  # field i holds column PACK_ORDER[i]
    codes = torch.empty_like(fields)
    codes[..., list(PACK_ORDER)] = fields
    return codes.flatten(-2)


def check(w: AWQWeight) -> None:
    """Shapes and dtypes of one layer's AWQ tensors agree; ValueError naming the mismatch otherwise."""
    k, n_words = w.qweight.shape
    groups, n = w.scales.shape
    if w.qweight.dtype != torch.int32 or w.qzeros.dtype != torch.int32:
        raise ValueError(f"qweight and qzeros must be int32, got {w.qweight.dtype} and {w.qzeros.dtype}")
    if n != n_words * PACK or tuple(w.qzeros.shape) != (groups, n_words) or not groups or k % groups:
        raise ValueError(f"AWQ tensors disagree: qweight {tuple(w.qweight.shape)}, qzeros {tuple(w.qzeros.shape)}, "
                         f"scales {tuple(w.scales.shape)}")


def dequantize(w: AWQWeight) -> torch.Tensor:
    """W (K, N) in fp32: (q - z) * s, each group's zero point and scale repeated over its rows."""
    check(w)
    g = w.group_size
    q = unpack(w.qweight).to(torch.float32)
    z = unpack(w.qzeros).to(torch.float32).repeat_interleave(g, dim=0)
    s = w.scales.to(torch.float32).repeat_interleave(g, dim=0)
    return (q - z) * s


def quantize(weight: torch.Tensor, group_size: int) -> AWQWeight:
    """Round-to-nearest asymmetric int4 of W (K, N) in groups of group_size rows, AutoAWQ's zero-point scheme without
    its scale search: s = (max - min) / 15 per group and column (stored in fp16; the codes are rounded against the
    stored scale), z = round(-min / s), q = clamp(round(w / s) + z, 0, 15)."""
    k, n = weight.shape
    if group_size < 1 or k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group_size}")
    w = weight.to(torch.float32).view(k // group_size, group_size, n)
    lo, hi = w.amin(dim=1), w.amax(dim=1)
    scales = ((hi - lo).clamp(min=1e-5) / MAX_CODE).to(torch.float16)
    s = scales.to(torch.float32)
    zeros = torch.round(-lo / s).clamp(0, MAX_CODE)
    codes = (torch.round(w / s[:, None, :]) + zeros[:, None, :]).clamp(0, MAX_CODE)
    return AWQWeight(pack(codes.view(k, n).to(torch.int32)), pack(zeros.to(torch.int32)), scales)
