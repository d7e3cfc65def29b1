"""The marlin path's few-token GEMM: y = x W^T for a handful of tokens, straight from Marlin's NVFP4 layout.

At one token Marlin reads a layer's NVFP4 weight at 0.5-2 TB/s of an H100's ~3 (its small layers are latency-bound,
`profile_weights/h100-cloverlm-4b-29l-b1x1024.md`), while decode is a pass over the weights: this kernel splits K
across enough programs to fill the GPU and streams the codes with 16-byte loads.

Where Marlin keeps code (k, n) of a 16 x 64 tile (marlin_dequant's probed tables, checked against these formulas by
layout_matches at load): word n_lo * 16 + k21 * 4 + n54 of the tile's 128, nibble k0 * 4 + n3 * 2 + k3, where
n = n54 * 16 + n3 * 8 + n_lo and k = k3 * 8 + k21 * 2 + k0. So each program holds whole words as (n_lo, k21, n54),
each nibble adds one k to one of two column halves (n3), and a scale (one per 16 k: per tile row and column) is
applied once per tile. The scale of column n sits at byte n_lo * 8 + n5 * 4 + n3 * 2 + n4 of its 64-column block.

Split K: every program writes fp32 partial sums; the last of a column block's programs to finish (a ticket from an
atomic counter, reset by that program for the next launch and a CUDA graph's replay) sums the partials in a fixed
order, scales them and writes the output, all in one launch. The partials and tickets are one scratch per device
shared by every layer: a device's layers run their GEMMs on one stream, one after another (as marlin_dequant's
scratch).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...ops.utils import INTERPRETED, round_to
from .dequantize import e2m1_half
from .marlin_dequant import TILE_K, TILE_N, MarlinTables

MAX_TOKENS = 4  # tokens a call may take (the accumulators are per token)


class Config(NamedTuple):
    """A launch: k_tiles x n_tiles tiles of words per step of a program of `warps` warps; K split so that there are
    about programs_per_sm programs an SM (enough loads in flight to stream the weight)."""

    k_tiles: int = 2
    n_tiles: int = 2
    warps: int = 4
    programs_per_sm: int = 4


CONFIG = Config()


def expected_tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(word, shift, scale_column) of the layout this kernel reads, as marlin_dequant.MarlinTables lays them out."""
    k, n = torch.meshgrid(torch.arange(TILE_K), torch.arange(TILE_N), indexing="ij")
    word = (n % 8) * 16 + (k // 2 % 4) * 4 + n // 16
    nibble = (k % 2) * 4 + (n // 8 % 2) * 2 + k // 8
    c = torch.arange(TILE_N)
    scale_column = (c % 8) * 8 + (c // 32) * 4 + (c // 8 % 2) * 2 + (c // 16 % 2)
    return word.to(torch.int32), (4 * nibble).to(torch.int32), scale_column.to(torch.int32)


def layout_matches(t: MarlinTables) -> bool:
    """Whether the probed Marlin layout is the one this kernel reads."""
    return all(torch.equal(a.cpu(), b) for a, b in zip((t.word, t.shift, t.scale_column), expected_tables()))


@triton.jit(do_not_specialize=["M", "stride_xm", "tiles_per_split"], do_not_specialize_on_alignment=["x_ptr"])
def _gemv_kernel(x_ptr, codes_ptr, scales_ptr, part_ptr, ticket_ptr, out_ptr, M, N, K, stride_xm, padded_n,
                 tiles_per_split, alpha, MP: tl.constexpr, KT: tl.constexpr, NT: tl.constexpr,
                 SPLITS_PAD: tl.constexpr, INTERPRET: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    # a program's words: axes (k-tile of the step, n_lo) x k21 x (n-tile, n54)
    r = tl.arange(0, KT * 8)
    c = tl.arange(0, NT * 4)
    k21 = tl.arange(0, 4)
    n_lo, kt = r % 8, r // 8
    tile = pid_n * NT + c // 4
    n54 = c % 4
    tile_ok = tile < padded_n // 64
    word_off = (n_lo * 16)[:, None, None] + (k21 * 4)[None, :, None] + (tile * 128 + n54)[None, None, :]
    scale_off = (n_lo * 8)[:, None] + (tile * 64 + (n54 >> 1) * 4 + (n54 & 1))[None, :]
    m = tl.arange(0, MP)
    m_ok = m < M
    x_tok = x_ptr + (m * stride_xm)[:, None, None, None]
    k_tiles = K // 16
    first = split * tiles_per_split
    end = tl.minimum(first + tiles_per_split, k_tiles)
    acc0 = tl.zeros((MP, KT * 8, 4, NT * 4), tl.float32)  # columns with n3 = 0
    acc1 = tl.zeros((MP, KT * 8, 4, NT * 4), tl.float32)  # n3 = 1
    for base in range(first, end, KT):
        ktile = base + kt
        k_ok = ktile < end
        words = tl.load(codes_ptr + ktile.to(tl.int64)[:, None, None] * (2 * padded_n) + word_off,
                        mask=k_ok[:, None, None] & tile_ok[None, None, :], other=0)
        s_ptr = scales_ptr + ktile.to(tl.int64)[:, None] * padded_n + scale_off
        s_ok = k_ok[:, None] & tile_ok[None, :]
        # Marlin's S0E5M3 byte << 7 is the fp16 scale (x its lift x 2^7)
        s0 = (tl.load(s_ptr, mask=s_ok, other=0).to(tl.int16) << 7).to(tl.float16, bitcast=True).to(tl.float32)
        s1 = (tl.load(s_ptr + 2, mask=s_ok, other=0).to(tl.int16) << 7).to(tl.float16, bitcast=True).to(tl.float32)
        x_k = x_tok + (ktile * 16)[None, :, None, None] + (k21 * 2)[None, None, :, None]
        x_ok = m_ok[:, None, None, None] & k_ok[None, :, None, None]
        p0 = tl.zeros((MP, KT * 8, 4, NT * 4), tl.float32)
        p1 = tl.zeros((MP, KT * 8, 4, NT * 4), tl.float32)
        for j in tl.static_range(8):  # nibble j: k = (j & 1) * 8 + k21 * 2 + (j >> 2), column half n3 = j >> 1 & 1
            v = e2m1_half(words >> (4 * j)).to(tl.float32)[None, :, :, :]
            xj = tl.load(x_k + (j & 1) * 8 + (j >> 2), mask=x_ok, other=0).to(tl.float32)
            if (j >> 1) & 1 == 0:
                p0 += v * xj
            else:
                p1 += v * xj
        acc0 += p0 * s0[None, :, None, :]
        acc1 += p1 * s1[None, :, None, :]
    # (MP, KT * 8, 4, C) -> (MP, 8, C): sum over k21, then over the step's k-tiles
    y0 = tl.sum(tl.reshape(tl.sum(acc0, axis=2), (MP, KT, 8, NT * 4)), axis=1)
    y1 = tl.sum(tl.reshape(tl.sum(acc1, axis=2), (MP, KT, 8, NT * 4)), axis=1)
    col = (tile * 64 + n54 * 16)[None, None, :] + tl.arange(0, 8)[None, :, None]  # + n3 * 8
    col_ok = tile_ok[None, None, :]
    part = part_ptr + ((split * MP + m) * padded_n)[:, None, None] + col
    tl.store(part, y0, mask=col_ok)
    tl.store(part + 8, y1, mask=col_ok)
    tl.debug_barrier()  # every thread's partials written before the ticket is drawn
    if tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == splits - 1:
        s = tl.arange(0, SPLITS_PAD)[:, None, None, None]
        parts = part_ptr + ((s * MP + m[None, :, None, None]) * padded_n) + col[None]
        ok = (s < splits) & col_ok[None]
        t0 = tl.sum(tl.load(parts, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
        t1 = tl.sum(tl.load(parts + 8, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
        out = out_ptr + (m * N)[:, None, None] + col
        out_ok = m_ok[:, None, None] & (col < N)
        dtype = out_ptr.dtype.element_ty
        tl.store(out, round_to(t0 * alpha, dtype, INTERPRET), mask=out_ok)
        tl.store(out + 8, round_to(t1 * alpha, dtype, INTERPRET), mask=out_ok & (col + 8 < N))
        tl.store(ticket_ptr + pid_n, 0)  # the next launch (a CUDA graph's replay too) counts from zero


class Launch(NamedTuple):
    """The grid of one layer's GEMV."""

    n_programs: int
    splits: int
    tiles_per_split: int


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch(padded_n: int, k: int, device: torch.device, config: Config = CONFIG) -> Launch:
    """Split K so that n_programs x splits is about config.programs_per_sm programs an SM (no split empty)."""
    n_programs = triton.cdiv(padded_n // TILE_N, config.n_tiles)
    k_tiles = k // TILE_K
    steps = triton.cdiv(k_tiles, config.k_tiles)
    splits = max(1, min(steps, triton.cdiv(config.programs_per_sm * _sm_count(device), n_programs)))
    tiles_per_split = triton.cdiv(steps, splits) * config.k_tiles
    return Launch(n_programs, triton.cdiv(k_tiles, tiles_per_split), tiles_per_split)


_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def reserve_scratch(padded_n: int, k: int, device: torch.device, config: Config = CONFIG) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """(partials fp32, tickets int32, zero) of `device`, grown to fit a (padded_n, k) layer at MAX_TOKENS tokens:
    called at load, so that no CUDA graph captures an allocation and tickets start at zero."""
    device = torch.device(device)
    g = launch(padded_n, k, device, config)
    part, tickets = _SCRATCH.get(device, (None, None))
    need = g.splits * MAX_TOKENS * padded_n
    if part is None or part.numel() < need:
        part = torch.empty(need, dtype=torch.float32, device=device)
    if tickets is None or tickets.numel() < g.n_programs:
        tickets = torch.zeros(g.n_programs, dtype=torch.int32, device=device)
    _SCRATCH[device] = (part, tickets)
    return part, tickets


def gemv(x: torch.Tensor, codes: torch.Tensor, scale_bytes: torch.Tensor, n: int, k: int, alpha: float,
         config: Config = CONFIG) -> torch.Tensor:
    """alpha * x W^T for x (M <= MAX_TOKENS, K), W Marlin's NVFP4 weight (codes int32, S0E5M3 scale bytes), the fp32
    sums rounded once to x's dtype."""
    tokens = x.shape[0]
    if not 0 < tokens <= MAX_TOKENS or x.stride(1) != 1:
        raise ValueError(f"gemv takes 1 to {MAX_TOKENS} tokens with contiguous rows, got {tuple(x.shape)}")
    padded_n = scale_bytes.shape[1]
    g = launch(padded_n, k, x.device, config)
    part, tickets = _SCRATCH.get(x.device, (None, None))
    if part is None or part.numel() < g.splits * MAX_TOKENS * padded_n or tickets.numel() < g.n_programs:
        part, tickets = reserve_scratch(padded_n, k, x.device, config)
    out = x.new_empty((tokens, n))
    mp = triton.next_power_of_2(tokens)
    # 2^7: the scale bytes' fp16 reading is the scale x 2^7, e2m1_half's value x 2^-14
    _gemv_kernel[(g.n_programs, g.splits)](
        x, codes, scale_bytes.view(torch.uint8), part, tickets, out, tokens, n, k, x.stride(0), padded_n,
        g.tiles_per_split, alpha * 128.0, MP=mp, KT=config.k_tiles, NT=config.n_tiles,
        SPLITS_PAD=triton.next_power_of_2(g.splits), INTERPRET=INTERPRETED, num_warps=config.warps)
    return out


def warm(codes: torch.Tensor, scale_bytes: torch.Tensor, n: int, k: int, dtype: torch.dtype) -> None:
    """Compile (or fetch) the layer's kernels for every token count now, at load: never inside a request."""
    x = torch.zeros(MAX_TOKENS, k, dtype=dtype, device=codes.device)
    for tokens in range(1, MAX_TOKENS + 1):
        gemv(x[:tokens], codes, scale_bytes, n, k, 1.0)
