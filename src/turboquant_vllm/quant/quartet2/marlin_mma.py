"""The marlin path's few-token GEMM: y = x W^T for up to MAX_TOKENS tokens on the tensor cores, W decoded from
Marlin's NVFP4 layout in registers.

Marlin runs a batch of 64 tokens about twice as slowly as one (`nvfp4_gemm/h100-cloverlm-4b.md`: 18.9 vs 10.5 us for
3584 x 5376), slower than bf16 weights read from HBM: it decodes on the integer pipe and multiplies on mma.sync tiles
it feeds itself. Here each code word becomes 8 values by byte permutes (ops.utils.nibble_lookup_asm, the KV cache's
value lookup with E2M1's magnitudes: 16 integer ops per 8 values), times its block scale in the activations' dtype
(exact: at most 6 significant bits), and tl.dot multiplies them: the decode costs the same for 1 token as for 64.

Where Marlin keeps code (k, n) of a 16 x 64 tile (checked against the probed tables by layout_matches at load): word
n_lo * 16 + k21 * 4 + n54 of the tile's 128, nibble k0 * 4 + n3 * 2 + k3, where n = n54 * 16 + n3 * 8 + n_lo and
k = k3 * 8 + k21 * 2 + k0; so byte k0 * 2 + n3 of the word holds k3 = 0 in its low nibble and k3 = 1 in its high one.
A step's words are loaded as (k-tile, k21, (n-tile, n_lo, n54), byte); each (k0, n3, k3) slice of them is a
(k-tile x k21) x (n-tile, n_lo, n54) matrix multiplied by the activations' matching columns, so nothing is
transposed: the activations are gathered in that order and the output columns scattered back. The block scale of
column n sits at byte n_lo * 8 + n5 * 4 + n3 * 2 + n4 of its 64-column block of a k-tile's row.

Split K: every program writes fp32 partial sums; the last of a column block's programs to finish (a ticket from an
atomic counter, reset by that program for the next launch and a CUDA graph's replay) sums them in a fixed order,
scales by alpha and rounds once, all in one launch. One split writes the output directly. Partials and tickets are
one scratch per device shared by every layer (a device's layers run their GEMMs one after another on one stream).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...ops.utils import INTERPRETED, mma, nibble_lookup_asm, round_to
from . import nvfp4
from .marlin_dequant import TILE_K, TILE_N, MarlinTables

MAX_TOKENS = 64  # tokens a call may take: one tile of rows a program
MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1's, by the code's low 3 bits


class Config(NamedTuple):
    """A launch: k_tiles x n_tiles tiles (16 x 64) a step of a program of `warps` warps, `stages` steps in flight; K
    split so that there are about programs_per_sm programs an SM, but at most so many that the partials (4 B a token
    and column a split, written and read) stay below partial_budget of the weight's bytes."""

    k_tiles: int = 4
    n_tiles: int = 1
    warps: int = 4
    programs_per_sm: int = 4
    partial_budget: float = 0.25
    stages: int = 3


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


@functools.cache
def lookup_asm(dtype: torch.dtype) -> str:
    """The byte-permute decode of E2M1 codes into `dtype` values (bf16 or fp16 bit patterns of the magnitudes)."""
    bits = torch.tensor(MAGNITUDES, dtype=dtype).view(torch.int16).to(torch.int32).tolist()
    return nibble_lookup_asm(bits, 4)


@functools.cache
def lookup_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(16,) the values of the 16 E2M1 codes in `dtype`: the interpreter's decode (it runs no PTX)."""
    return nvfp4.e2m1_value(torch.arange(16, device=device)).to(dtype)


@triton.jit
def _x_tile(x_ptr, m, m_ok, stride_xm, ktile, k_ok, BM: tl.constexpr, KT: tl.constexpr, UPCAST: tl.constexpr):
    """(BM, 16 KT): x at k = ktile * 16 + k3 * 8 + k21 * 2 + k0, columns ordered (k3, k-tile, k21, k0)."""
    k3 = tl.arange(0, 2)[:, None, None, None]
    k21 = tl.arange(0, 4)[None, None, :, None]
    k0 = tl.arange(0, 2)[None, None, None, :]
    col = (ktile * 16)[None, :, None, None] + k3 * 8 + k21 * 2 + k0  # (2, KT, 4, 2)
    ptr = x_ptr + (m * stride_xm)[:, None, None, None, None] + col[None]
    xs = tl.load(ptr, mask=m_ok[:, None, None, None, None] & k_ok[None, None, :, None, None], other=0.0)
    xs = tl.reshape(xs, (BM, KT * 16))
    return xs.to(tl.float32) if UPCAST else xs


@triton.jit
def _step_operands(x_ptr, codes_ptr, scales_ptr, m, m_ok, stride_xm, padded_n, byte_off, scale_off, tile_ok, ktile,
                   end, BM: tl.constexpr, KT: tl.constexpr, UPCAST: tl.constexpr):
    """A step's code bytes and scale bytes (k-tile, k21 / 1, column of words, byte k0 * 2 + n3: a byte's block scale is
    its column half n3's) and x tile; k-tiles from `end` on read as zeros."""
    k_ok = ktile < end
    ok = k_ok[:, None, None, None] & tile_ok[None, None, :, None]
    codes = tl.load(codes_ptr + ktile.to(tl.int64)[:, None, None, None] * (8 * padded_n) + byte_off, mask=ok, other=0)
    scale_bytes = tl.load(scales_ptr + ktile.to(tl.int64)[:, None, None, None] * padded_n + scale_off, mask=ok, other=0)
    return codes, scale_bytes, _x_tile(x_ptr, m, m_ok, stride_xm, ktile, k_ok, BM, KT, UPCAST)


@triton.jit(do_not_specialize=["M", "stride_xm", "tiles_per_split"], do_not_specialize_on_alignment=["x_ptr"])
def _mma_kernel(x_ptr, codes_ptr, scales_ptr, lut_ptr, part_ptr, ticket_ptr, out_ptr, M, N, K, stride_xm, padded_n,
                tiles_per_split, alpha, BM: tl.constexpr, MAX_M: tl.constexpr, KT: tl.constexpr, NT: tl.constexpr,
                SPLITS_PAD: tl.constexpr, LOOKUP_ASM: tl.constexpr, INTERPRET: tl.constexpr):
    C: tl.constexpr = NT * 32  # a step's columns of words: (n-tile, n_lo, n54)
    dtype = x_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    c = tl.arange(0, C)
    n_lo, n54 = c // 4 % 8, c % 4
    tile = pid_n * NT + c // 32
    tile_ok = tile < padded_n // 64
    k21 = tl.arange(0, 4)
    byte = tl.arange(0, 4)
    kt = tl.arange(0, KT)
    # a k-tile row of words is 2 padded_n words (8 padded_n bytes); word n_lo * 16 + k21 * 4 + n54 of its tile
    byte_off = (((k21 * 4)[:, None, None] + (tile * 128 + n_lo * 16 + n54)[None, :, None]) * 4
                + byte[None, None, :])[None, :, :, :]
    # the block scale of (k-tile, column of words c, byte k0 * 2 + n3): n3 = 0 here, n3 = 1 two bytes on
    scale_off = (tile * 64 + n_lo * 8 + (n54 >> 1) * 4 + (n54 & 1))[None, None, :, None] + ((byte & 1) * 2)[None, None,
                                                                                                         None, :]
    m = tl.arange(0, BM)
    m_ok = m < M
    first = split * tiles_per_split
    end = tl.minimum(first + tiles_per_split, K // 16)
    acc = tl.zeros((BM, 2 * C), tl.float32)  # columns (n3, c)
    codes, scale_bytes, x = _step_operands(x_ptr, codes_ptr, scales_ptr, m, m_ok, stride_xm, padded_n, byte_off,
                                           scale_off, tile_ok, first + kt, end, BM, KT, INTERPRET)
    for base in range(first, end, KT):
        # the next step's operands are loaded before this step's decode and product, so their latency overlaps them
        next_codes, next_scale_bytes, next_x = _step_operands(x_ptr, codes_ptr, scales_ptr, m, m_ok, stride_xm,
                                                              padded_n, byte_off, scale_off, tile_ok, base + KT + kt,
                                                              end, BM, KT, INTERPRET)
        if LOOKUP_ASM != "":
            lo, hi = tl.inline_asm_elementwise(LOOKUP_ASM, "=r,=r,=r,=r,r", [codes], dtype=(dtype, dtype),
                                               is_pure=True, pack=4)
        else:
            lo = tl.load(lut_ptr + (codes & 15).to(tl.int32))
            hi = tl.load(lut_ptr + (codes >> 4).to(tl.int32))
        # Marlin's S0E5M3 byte << 7 is the fp16 scale x vLLM's lift x 2^7
        scale = (scale_bytes.to(tl.int16) << 7).to(tl.float16, bitcast=True).to(tl.float32) * 0.0078125
        if INTERPRET:  # its half-precision arithmetic is wrong: products in fp32 (exact all the same)
            lo, hi = lo.to(tl.float32) * scale, hi.to(tl.float32) * scale
        else:
            scale = scale.to(dtype)
            lo, hi = lo * scale, hi * scale
        # (k3, k-tile, k21, byte = (k0, n3), column of words) -> rows (k3, k-tile, k21, k0) x columns (n3, c)
        w = tl.permute(tl.join(lo, hi), (4, 0, 1, 3, 2))
        acc = mma(x, tl.reshape(w, (KT * 16, 2 * C)), acc, INTERPRET)
        codes, scale_bytes, x = next_codes, next_scale_bytes, next_x
    acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, C)), (0, 2, 1)))  # columns with n3 = 0, 1
    col = (tile * 64 + n54 * 16 + n_lo)[None, :]  # + n3 * 8
    row_ok = m_ok[:, None] & tile_ok[None, :]
    out = out_ptr + (m * N)[:, None] + col
    if splits == 1:
        tl.store(out, round_to(acc0 * alpha, dtype, INTERPRET), mask=row_ok & (col < N))
        tl.store(out + 8, round_to(acc1 * alpha, dtype, INTERPRET), mask=row_ok & (col + 8 < N))
    else:
        part = part_ptr + ((split * MAX_M + m) * padded_n)[:, None] + col
        tl.store(part, acc0, mask=row_ok)
        tl.store(part + 8, acc1, mask=row_ok)
        tl.debug_barrier()  # every thread's partials written before the ticket is drawn
        if tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == splits - 1:
            s = tl.arange(0, SPLITS_PAD)[:, None, None]
            parts = part_ptr + (s * MAX_M + m[None, :, None]) * padded_n + col[None]
            ok = (s < splits) & row_ok[None]
            t0 = tl.sum(tl.load(parts, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
            t1 = tl.sum(tl.load(parts + 8, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
            tl.store(out, round_to(t0 * alpha, dtype, INTERPRET), mask=row_ok & (col < N))
            tl.store(out + 8, round_to(t1 * alpha, dtype, INTERPRET), mask=row_ok & (col + 8 < N))
            tl.store(ticket_ptr + pid_n, 0)  # the next launch (a CUDA graph's replay too) counts from zero


class Launch(NamedTuple):
    """The grid of one layer's GEMM."""

    n_programs: int
    splits: int
    tiles_per_split: int


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch(padded_n: int, k: int, tokens: int, device: torch.device, config: Config = CONFIG) -> Launch:
    """Split K so that n_programs x splits is about config.programs_per_sm programs an SM, within the partials'
    budget for `tokens` tokens, no split empty."""
    n_programs = triton.cdiv(padded_n // TILE_N, config.n_tiles)
    k_tiles = k // TILE_K
    steps = triton.cdiv(k_tiles, config.k_tiles)
    fill = triton.cdiv(config.programs_per_sm * _sm_count(device), n_programs)
    # partial bytes 8 x tokens x padded_n x splits against weight bytes 0.5625 x padded_n x k
    budget = int(config.partial_budget * 0.5625 * k / (8 * max(1, tokens)))
    splits = max(1, min(steps, fill, budget))
    tiles_per_split = triton.cdiv(steps, splits) * config.k_tiles
    return Launch(n_programs, triton.cdiv(k_tiles, tiles_per_split), tiles_per_split)


_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def reserve_scratch(padded_n: int, k: int, device: torch.device, config: Config = CONFIG) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """(partials fp32, tickets int32, zero) of `device`, grown to fit a (padded_n, k) layer at any token count up to
    MAX_TOKENS: called at load, so that no CUDA graph captures an allocation and tickets start at zero."""
    device = torch.device(device)
    splits = max(launch(padded_n, k, t, device, config).splits for t in range(1, MAX_TOKENS + 1))
    n_programs = launch(padded_n, k, 1, device, config).n_programs
    part, tickets = _SCRATCH.get(device, (None, None))
    need = splits * MAX_TOKENS * padded_n
    if part is None or part.numel() < need:
        part = torch.empty(need, dtype=torch.float32, device=device)
    if tickets is None or tickets.numel() < n_programs:
        tickets = torch.zeros(n_programs, dtype=torch.int32, device=device)
    _SCRATCH[device] = (part, tickets)
    return part, tickets


def rows_tile(tokens: int) -> int:
    """The program's tile of rows for `tokens` tokens: 16 (the MMA's least), 32 or 64."""
    return max(16, triton.next_power_of_2(tokens))


def mma_linear(x: torch.Tensor, codes: torch.Tensor, scale_bytes: torch.Tensor, n: int, k: int, alpha: float,
               config: Config = CONFIG) -> torch.Tensor:
    """alpha * x W^T for x (M <= MAX_TOKENS, K), W Marlin's NVFP4 weight (codes int32, S0E5M3 scale bytes), the fp32
    sums rounded once to x's dtype (alpha: the tensor scale / vLLM's scale lift, marlin.MarlinNVFP4.dense_alpha)."""
    tokens = x.shape[0]
    if not 0 < tokens <= MAX_TOKENS or x.stride(1) != 1:
        raise ValueError(f"mma_linear takes 1 to {MAX_TOKENS} tokens with contiguous rows, got {tuple(x.shape)}")
    padded_n = scale_bytes.shape[1]
    g = launch(padded_n, k, tokens, x.device, config)
    part, tickets = _SCRATCH.get(x.device, (None, None))
    if part is None or part.numel() < g.splits * MAX_TOKENS * padded_n or tickets.numel() < g.n_programs:
        part, tickets = reserve_scratch(padded_n, k, x.device, config)
    out = x.new_empty((tokens, n))
    _mma_kernel[(g.n_programs, g.splits)](
        x, codes.view(torch.uint8), scale_bytes.view(torch.uint8), lookup_table(x.device, x.dtype), part, tickets, out,
        tokens, n, k, x.stride(0), padded_n, g.tiles_per_split, alpha, BM=rows_tile(tokens), MAX_M=MAX_TOKENS,
        KT=config.k_tiles, NT=config.n_tiles, SPLITS_PAD=triton.next_power_of_2(g.splits),
        LOOKUP_ASM="" if INTERPRETED else lookup_asm(x.dtype), INTERPRET=INTERPRETED, num_warps=config.warps,
        num_stages=config.stages)
    return out


def warm(codes: torch.Tensor, scale_bytes: torch.Tensor, n: int, k: int, dtype: torch.dtype,
         max_tokens: int = MAX_TOKENS) -> None:
    """Compile (or fetch) the kernel for every tile of rows up to max_tokens now, at load: never inside a request."""
    x = torch.zeros(max_tokens, k, dtype=dtype, device=codes.device)
    for tokens in sorted({min(max_tokens, rows_tile(t)) for t in range(1, max_tokens + 1)}):
        mma_linear(x[:tokens], codes, scale_bytes, n, k, 1.0)
