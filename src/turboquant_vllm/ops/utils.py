"""Pieces shared by the Triton kernels: code planes and launch checks."""

from __future__ import annotations

import functools
import os
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from ..core.calibration import KeyCalibration
from ..core.layout import CacheLayout

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# Triton's CPU interpreter runs no inline PTX and mis-multiplies half-precision MMA operands.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def codes_to_plane_bytes(codes, ROWS: tl.constexpr, DIM: tl.constexpr, WIDTH: tl.constexpr):
    """(ROWS, DIM) int32 codes < 2^WIDTH -> (ROWS, DIM * WIDTH / 8) uint8, natural order."""
    PER_BYTE: tl.constexpr = 8 // WIDTH
    shifts = tl.arange(0, PER_BYTE) * WIDTH
    grouped = tl.reshape(codes, (ROWS, DIM // PER_BYTE, PER_BYTE)) << shifts[None, None, :]
    return tl.sum(grouped, axis=2).to(tl.uint8)


@triton.jit
def round_to(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 x to dtype, rounding to nearest even (Triton's CPU interpreter truncates fp32 -> bf16)."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def dot_fp32(x, m, acc, INTERPRET: tl.constexpr):
    """acc + x @ m of fp32 tiles, 3xTF32 on the GPU; interpreted, as sums of products: NumPy's matmul (the
    interpreter's dot) may round an element by where its row sits in the tile, and a row must come out the same
    wherever it sits (batch invariance)."""
    if INTERPRET:
        return acc + tl.sum(x[:, :, None] * m[None, :, :], axis=1)
    return tl.dot(x, m, acc, input_precision="tf32x3")


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b; UPCAST runs it in fp32 (Triton's CPU interpreter mis-multiplies half-precision operands)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


# PTX that regroups 2- and 3-bit codes into the 4-bit lookup's bytes: sign (bit BITS - 1 of a code, core.codebook)
# on bit 3 of a nibble, magnitude index in bits 0..2; one nibble per coordinate, even coordinates low. $4: each
# byte holds a pair's low-plane bits (2 bits per coordinate), $5: the pair's top bits (3 bits: the signs) in bits 0..1.
# lop3 0xF8 is a | (b & c).
_REGROUP = {
    2: """and.b32 w, $4, 0x01010101;
    shl.b32 x, $4, 2;
    lop3.b32 w, w, x, 0x18181818, 0xF8;
    shl.b32 x, $4, 4;
    lop3.b32 w, w, x, 0x80808080, 0xF8;""",
    3: """and.b32 w, $4, 0x03030303;
    shl.b32 x, $4, 2;
    lop3.b32 w, w, x, 0x30303030, 0xF8;
    shl.b32 x, $5, 3;
    lop3.b32 w, w, x, 0x08080808, 0xF8;
    shl.b32 x, $5, 6;
    lop3.b32 w, w, x, 0x80808080, 0xF8;""",
    4: "mov.b32 w, $4;",
}


# A zero ptxas cannot prove zero (the lanes below this one and those above it are disjoint sets). A table word or-ed
# with it is a loop-invariant register; a plain constant table lives in a uniform register, and ptxas copies it into a
# register before every byte permute that reads it (94 copies per decode tile, 9.5% of the loop:
# benchmarks/results/kernel_sass/sm90-attention-loops.log at commit 98a39d8).
def _opaque_zero(z: str, tmp: str) -> str:
    return f"mov.u32 {z}, %lanemask_lt; mov.u32 {tmp}, %lanemask_gt; and.b32 {z}, {z}, {tmp};"


def nibble_lookup_asm(magnitudes_fp16: list[int], bits: int = 4) -> str:
    """PTX that turns 4 bytes of codes (a coordinate pair each) into 8 fp16 values with byte permutes; "" for widths
    it does not cover (5 bits: a 16-entry table does not fit a byte permute's 8).

    4 bits: byte = 2 sign-magnitude nibbles. 2 and 3 bits: _REGROUP builds those nibbles from the planes first.
    The (up to) 8 magnitudes live in registers as a low-byte table and a high-byte table; one prmt looks up 4
    codes' low bytes, one their high bytes. The sign bit of each code is moved onto bit 7 of its high byte (one
    prmt of the word and the word << 4, one lop3 per 4 codes), and two prmts interleave low and high bytes into
    fp16 pairs. 16 integer ops per 8 values after the regroup, no memory access.
    Outputs: $0, $1 = values of the even coordinates of bytes 0..3, $2, $3 = of the odd coordinates; inputs: $4 =
    the 4 bytes, $5 (3 bits: the 4 pairs' top bits; ignored otherwise).
    """
    if bits not in _REGROUP:
        return ""
    mags = list(magnitudes_fp16) + [0] * (8 - len(magnitudes_fp16))
    lo = [m & 0xFF for m in mags]
    hi = [m >> 8 for m in mags]
    word = lambda b: b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24  # noqa: E731
    # Byte i of sa / sb is the high byte of code i (codes 0..3 / 4..7), its bit 7 that code's sign bit.
    return f"""{{
    .reg .b32 tl0, tl1, th0, th1, sa, sb, w, x, w4, la, ha, lb, hb;
    {_REGROUP[bits]}
    {_opaque_zero("x", "w4")}
    or.b32 tl0, x, {word(lo[:4]):#x}; mov.b32 tl1, {word(lo[4:]):#x};
    or.b32 th0, x, {word(hi[:4]):#x}; mov.b32 th1, {word(hi[4:]):#x};
    and.b32 sa, w, 0x7777;
    shr.u32 sb, w, 16;
    and.b32 sb, sb, 0x7777;
    prmt.b32 la, tl0, tl1, sa;
    prmt.b32 ha, th0, th1, sa;
    prmt.b32 lb, tl0, tl1, sb;
    prmt.b32 hb, th0, th1, sb;
    shl.b32 w4, w, 4;
    prmt.b32 sa, w, w4, 0x1504;
    prmt.b32 sb, w, w4, 0x3726;
    lop3.b32 ha, ha, sa, 0x80808080, 0x78;
    lop3.b32 hb, hb, sb, 0x80808080, 0x78;
    prmt.b32 $0, la, ha, 0x6240;
    prmt.b32 $1, lb, hb, 0x6240;
    prmt.b32 $2, la, ha, 0x7351;
    prmt.b32 $3, lb, hb, 0x7351;
}}"""


def nibble_int8_asm(table: list[int]) -> str:
    """PTX that turns 4 bytes of 4-bit sign-magnitude codes into 8 int8 values with byte permutes.

    table: the 8 magnitudes as int8 t >= 0 standing for t + 1/2; the negative of t + 1/2 is ~t + 1/2
    (~t = -t - 1), so the sign is one xor. One prmt looks up 4 codes' magnitudes, one turns their sign bits into
    0x00 / 0xff bytes (prmt's sign-replicate mode on the word and the word << 4). 10 ops per 8 values.
    Outputs: $0 = values of coordinates 0..3 of the 4 bytes (natural order), $1 = coordinates 4..7;
    $2 = the 4 input bytes.
    """
    word = lambda b: b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24  # noqa: E731
    return f"""{{
    .reg .b32 t0, t1, s, w4, m;
    {_opaque_zero("s", "m")}
    or.b32 t0, s, {word(table[:4]):#x}; mov.b32 t1, {word(table[4:]):#x};
    shl.b32 w4, $2, 4;
    and.b32 s, $2, 0x7777;
    prmt.b32 m, t0, t1, s;
    prmt.b32 s, $2, w4, 0x9D8C;
    xor.b32 $0, m, s;
    shr.u32 s, $2, 16;
    and.b32 s, s, 0x7777;
    prmt.b32 m, t0, t1, s;
    prmt.b32 s, $2, w4, 0xBFAE;
    xor.b32 $1, m, s;
}}"""


@triton.jit
def load_int8_quads(cache_ptr, rec_base, valid, lut_ptr, ASM: tl.constexpr, HEAD_DIM: tl.constexpr,
                    D_PAD: tl.constexpr, AXIS: tl.constexpr = -1):
    """4-bit codes of records at rec_base as int8 t standing for (t + 1/2) * the codebook's int8_step:
    (coordinates 8i + 0..3, coordinates 8i + 4..7) for i < D_PAD / 8, each (..., D_PAD / 2) for rec_base and
    valid of shape (..., 1); AXIS=1: the coordinates run along axis 1 of a 3-D result instead (rec_base and valid
    (W, 1, N), result (W, D_PAD / 2, N)), the order an MMA operand with the codes on its K side wants."""
    DH: tl.constexpr = D_PAD // 2
    j = tl.arange(0, DH)
    if AXIS == 1:
        j = j[:, None]
    if ASM != "":
        packed = tl.load(cache_ptr + rec_base + j, mask=valid & (j < HEAD_DIM // 2), other=0)
        a, b = tl.inline_asm_elementwise(ASM, "=r,=r,r", [packed], dtype=(tl.int8, tl.int8), is_pure=True, pack=4)
        return a, b
    byte = 4 * (j // 4) + (j % 4) // 2  # byte of coordinate 8 (j // 4) + j % 4, nibble j % 2
    ok = valid & (byte < HEAD_DIM // 2)
    a = tl.load(cache_ptr + rec_base + byte, mask=ok, other=0).to(tl.int32)
    b = tl.load(cache_ptr + rec_base + 2 + byte, mask=ok, other=0).to(tl.int32)
    shift = 4 * (j % 2)
    return tl.load(lut_ptr + ((a >> shift) & 15)), tl.load(lut_ptr + ((b >> shift) & 15))


@triton.jit
def locate_tokens(block_table_row, n, n_ok, stride_cblock, head_base, BLOCK_SIZE: tl.constexpr):
    """(byte offset of each token n's page, its KV head's part at head_base, n's slot in the page).

    Unsigned, as token positions and block ids are: // and % become shifts, and the page offset one widening
    multiply (stride_cblock < 2^31: check_cache); signed arithmetic cost the decode loop 62 instructions."""
    nu = n.to(tl.uint32)
    phys = tl.load(block_table_row + nu // BLOCK_SIZE, mask=n_ok, other=0)
    page = phys.to(tl.uint32).to(tl.uint64) * stride_cblock.to(tl.uint32).to(tl.uint64) + head_base.to(tl.uint64)
    return page, (nu % BLOCK_SIZE).to(tl.int32)


@triton.jit
def pair_index(t, BITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The coordinate pair p (coordinates 2p, 2p + 1) that element t of a load_halves tile holds. 4 and 5 bits
    (a byte of low bits per pair): p = t. 2 and 3 bits store their planes byte-sliced over groups of 8 coordinates
    (core.packing), and element t holds p = 4 (t % Q) + t // Q, Q = HEAD_DIM / 8: then Q consecutive elements read
    Q consecutive bytes of each plane at one shift (loads the compiler can vectorize and pipeline). Elements past
    HEAD_DIM / 2 stay past it (p = t)."""
    if BITS >= 4:
        p = t
    else:
        Q: tl.constexpr = HEAD_DIM // 8
        p = tl.where(t < HEAD_DIM // 2, 4 * (t % Q) + t // Q, t)
    return p


@triton.jit
def load_halves(cache_ptr, rec_base, valid, lut_ptr, ASM: tl.constexpr, BITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                PAIRS: tl.constexpr, J0: tl.constexpr = 0, AXIS: tl.constexpr = -1):
    """Values of the coordinate pairs pair_index(J0 .. J0 + PAIRS - 1) of the records at rec_base as (even
    coordinates, odd coordinates), fp16 (..., PAIRS) for rec_base and valid of shape (..., 1); AXIS=1 as in
    load_int8_quads. Elements past HEAD_DIM / 2 decode as code 0. ASM: nibble_lookup_asm for BITS ("": table
    gathers)."""
    tl.static_assert(BITS >= 2 and BITS <= 5, "codes of 2 to 5 bits")
    j = J0 + tl.arange(0, PAIRS)
    if AXIS == 1:
        j = j[:, None]
    ok = valid & (j < HEAD_DIM // 2)
    # One if / elif chain, no early return: Triton compiles the code after a return in a constexpr branch too.
    if BITS == 4:  # byte j holds coordinates 2j (low nibble) and 2j+1 (high nibble)
        packed = tl.load(cache_ptr + rec_base + j, mask=ok, other=0)
        if ASM != "":
            even, odd = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r", [packed], dtype=(tl.float16, tl.float16),
                                                  is_pure=True, pack=4)
        else:
            even = tl.load(lut_ptr + (packed & 15).to(tl.int32))
            odd = tl.load(lut_ptr + (packed >> 4).to(tl.int32))
    elif BITS == 5:  # the low 4 bits as 4-bit codes (byte j), then the top plane: byte j // 4, bits 2 (j % 4), + 1
        low = tl.load(cache_ptr + rec_base + j, mask=ok, other=0).to(tl.int32)
        top = tl.load(cache_ptr + rec_base + HEAD_DIM // 2 + j // 4, mask=ok, other=0).to(tl.int32)  # L1 hits
        top = top >> (2 * (j % 4))
        even = tl.load(lut_ptr + ((low & 15) | ((top & 1) << 4)))  # 16 magnitudes: no byte-permute lookup
        odd = tl.load(lut_ptr + ((low >> 4) | ((top & 2) << 3)))
    else:
        # Element j holds pair k = j // Q of group g = j % Q of 8 coordinates (pair_index). Byte-sliced planes
        # (core.packing): its low bits are nibble k % 2 of byte k // 2 of group g (2 bits a coordinate), its top
        # bits (3 bits: the signs) field k of the top plane's byte g.
        Q: tl.constexpr = HEAD_DIM // 8
        g = j % Q
        k = j // Q
        low = (tl.load(cache_ptr + rec_base + (k // 2) * Q + g, mask=ok, other=0) >> (4 * (k % 2))).to(tl.uint8)
        top = low
        if BITS == 3:
            top = tl.load(cache_ptr + rec_base + HEAD_DIM // 4 + g, mask=ok, other=0)
            top = (top >> (2 * k)).to(tl.uint8)
        if ASM != "":
            even, odd = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r", [low, top],
                                                  dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            code_even = (low & 3).to(tl.int32)
            code_odd = ((low >> 2) & 3).to(tl.int32)
            if BITS == 3:
                code_even |= (top & 1).to(tl.int32) << 2
                code_odd |= ((top >> 1) & 1).to(tl.int32) << 2
            even = tl.load(lut_ptr + code_even)
            odd = tl.load(lut_ptr + code_odd)
    return even, odd


def check_cache(kv_cache: torch.Tensor, layout: CacheLayout) -> None:
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 3 or tuple(kv_cache.shape[1:]) != layout.cache_shape(0)[1:]:
        raise ValueError(
            f"kv_cache must be uint8 of shape (num_blocks, {layout.num_kv_heads}, {layout.head_page_bytes}) "
            f"for this layout, got {kv_cache.dtype} {tuple(kv_cache.shape)}"
        )
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != layout.head_page_bytes:
        raise ValueError("each block of kv_cache must be contiguous")
    if kv_cache.stride(0) >= 2**31:  # the readers multiply it unsigned 32 x 32 -> 64 bits (locate_tokens)
        raise ValueError(f"a block of kv_cache spans {kv_cache.stride(0)} bytes; at most 2^31 - 1 are supported")


def check_calibration(key_calibration: KeyCalibration, layout: CacheLayout) -> None:
    expected = (layout.num_kv_heads, layout.head_dim)
    if tuple(key_calibration.mean.shape) != expected:
        raise ValueError(f"key calibration is for (kv_heads, head_dim) {tuple(key_calibration.mean.shape)}, the cache "
                         f"for {expected}")


def check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} must be float16 or bfloat16, got {t.dtype}")


def check_index(name: str, t: torch.Tensor, like: torch.Tensor, dtypes=(torch.int32,)) -> None:
    """Metadata tensors: integer dtype the kernel reads, on the same device as the data."""
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but the data is on {like.device}")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=None)
def page_constants(layout: CacheLayout) -> MappingProxyType:
    """The page layout as the constexprs every kernel that reads or writes the cache takes (read-only: computed once
    per layout, outside the launches' host path)."""
    return MappingProxyType(dict(
        HEAD_DIM=layout.head_dim, D_PAD=next_pow2(layout.head_dim), BLOCK_SIZE=layout.block_size,
        K_BITS=layout.preset.k_bits, V_BITS=layout.preset.v_bits, K_CODE_BYTES=layout.key_code_bytes,
        V_CODE_BYTES=layout.value_code_bytes, K_NORM_OFF=layout.key_norm_offset, V_CODE_OFF=layout.value_code_offset,
        V_NORM_OFF=layout.value_norm_offset,
    ))
