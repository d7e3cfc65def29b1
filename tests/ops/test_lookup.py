import pytest
import torch
import triton
import triton.language as tl

from turboquant_vllm.core.packing import pack_codes
from turboquant_vllm.core.quantizer import Quantizer
from turboquant_vllm.ops.constants import _constants


@triton.jit
def _decode_int8(packed_ptr, a_ptr, b_ptr, ASM: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    a, b = tl.inline_asm_elementwise(ASM, "=r,=r,r", [tl.load(packed_ptr + i)], dtype=(tl.int8, tl.int8),
                                     is_pure=True, pack=4)
    tl.store(a_ptr + i, a)
    tl.store(b_ptr + i, b)


@triton.jit
def _decode(packed_ptr, even_ptr, odd_ptr, ASM: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    even, odd = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r", [tl.load(packed_ptr + i)],
                                          dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    tl.store(even_ptr + i, even)
    tl.store(odd_ptr + i, odd)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_nibble_asm_matches_code_table(head_dim):
    """The byte-permute lookup returns exactly the fp16 table value of every 4-bit code."""
    codes = torch.randint(0, 16, (512, 16), dtype=torch.int32, generator=torch.Generator().manual_seed(head_dim))
    codes[0] = torch.arange(16)  # every code at least once
    packed = pack_codes(codes, 4).view(-1).cuda()  # byte j: codes 2j (low nibble) and 2j+1 (high nibble)
    codes = codes.view(-1, 2)
    even = torch.full((4096,), float("nan"), dtype=torch.float16, device="cuda")
    odd = torch.full_like(even, float("nan"))
    c = _constants(4, 4, head_dim, torch.device("cuda"))
    _decode[(1,)](packed, even, odd, ASM=c.value_lookup_asm, N=4096)
    table = Quantizer(4, head_dim).code_values("cuda", torch.float16)
    assert torch.equal(even, table[codes[:, 0].cuda().long()])
    assert torch.equal(odd, table[codes[:, 1].cuda().long()])


@triton.jit
def _decode_planes(low_ptr, top_ptr, even_ptr, odd_ptr, ASM: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    even, odd = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r", [tl.load(low_ptr + i), tl.load(top_ptr + i)],
                                          dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    tl.store(even_ptr + i, even)
    tl.store(odd_ptr + i, odd)


def _plane_codes(bits: int, low: torch.Tensor, top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What kernels.common.load_halves hands the 2- and 3-bit lookup: a pair's low-plane bits in bits 0..3 of `low`,
    its top bits (3 bits: the signs) in bits 0..1 of `top`, anything above; the codes of its two coordinates."""
    even, odd = low & 3, (low >> 2) & 3
    if bits == 3:
        even, odd = even | (top & 1) << 2, odd | (top >> 1 & 1) << 2
    return even, odd


def _run_ptx(program: str, word: int, num_outputs: int = 4, word2: int = 0, lane: int = 0) -> list[int]:
    """Executes a lookup's PTX (mov / and / or / xor / shr / shl / prmt / lop3 on .b32) for one or two input words,
    as lane `lane` of a warp (the lane masks)."""
    regs = {f"${num_outputs}": word, f"${num_outputs + 1}": word2, "%lanemask_lt": (1 << lane) - 1,
            "%lanemask_gt": 0xFFFFFFFF << lane + 1 & 0xFFFFFFFF}
    val = lambda x: int(x, 0) if x[0].isdigit() else regs[x]  # noqa: E731
    for line in program.replace("{", "").replace("}", "").split(";"):
        parts = line.replace(",", " ").split()
        if not parts or parts[0] == ".reg":
            continue
        op, dst, *src = parts
        a = [val(x) for x in src]
        if op in ("mov.b32", "mov.u32"):
            r = a[0]
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "or.b32":
            r = a[0] | a[1]
        elif op == "xor.b32":
            r = a[0] ^ a[1]
        elif op == "shr.u32":
            r = a[0] >> a[1]
        elif op == "shl.b32":
            r = a[0] << a[1]
        elif op == "prmt.b32":  # byte i of d = byte (selector nibble i & 7) of {b, a}; nibble bit 3: sign fill
            pool = (a[1] << 32 | a[0]).to_bytes(8, "little")
            out = []
            for i in range(4):
                sel = a[2] >> 4 * i & 15
                byte = pool[sel & 7]
                out.append((0xFF if byte & 0x80 else 0) if sel & 8 else byte)
            r = int.from_bytes(bytes(out), "little")
        elif op == "lop3.b32":  # bit-wise LUT over (a, b, c) with a = 0xF0, b = 0xCC, c = 0xAA
            r = sum(1 << bit for bit in range(32)
                    if a[3] >> ((a[0] >> bit & 1) << 2 | (a[1] >> bit & 1) << 1 | (a[2] >> bit & 1)) & 1)
        else:
            raise AssertionError(f"unexpected PTX op {op}")
        regs[dst] = r & 0xFFFFFFFF
    return [regs[f"${i}"] for i in range(num_outputs)]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_nibble_asm_program_on_cpu(head_dim):
    """The PTX program itself (emulated here; CI has no GPU): every code at every nibble position."""
    c = _constants(4, 4, head_dim, torch.device("cpu"))
    table = Quantizer(4, head_dim).code_values("cpu", torch.float16).view(torch.int16).tolist()
    gen = torch.Generator().manual_seed(head_dim)
    words = [sum(((k + j) % 16) << 4 * j for j in range(8)) for k in range(16)]  # each code at each position
    words += torch.randint(0, 2**32, (200,), generator=gen, dtype=torch.int64).tolist()
    for i, w in enumerate(words):
        nib = [w >> 4 * j & 15 for j in range(8)]  # nibble 2b = coordinate 2b of byte b, nibble 2b+1 = 2b+1
        got = [[r & 0xFFFF, r >> 16] for r in _run_ptx(c.value_lookup_asm, w, lane=i % 32)]
        want = [[nib[0], nib[2]], [nib[4], nib[6]], [nib[1], nib[3]], [nib[5], nib[7]]]
        assert got == [[table[x] & 0xFFFF for x in pair] for pair in want], hex(w)


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_plane_asm_program_on_cpu(bits, head_dim):
    """The 2- and 3-bit lookup's PTX (emulated): regroup into sign-magnitude nibbles, then the 4-bit permutes; every
    code at every byte position, with garbage in the bits the kernel leaves above each field."""
    c = _constants(bits, bits, head_dim, torch.device("cpu"))
    table = Quantizer(bits, head_dim).code_values("cpu", torch.float16).view(torch.int16).tolist()
    gen = torch.Generator().manual_seed(bits * 1000 + head_dim)
    low = torch.randint(0, 256, (400, 4), generator=gen)
    top = torch.randint(0, 256, (400, 4), generator=gen)
    low[:16, 0] = low[:16, 0] & 0xF0 | torch.arange(16)  # every low field and every sign pair at byte 0
    top[:16, 0] = top[:16, 0] & 0xFC | torch.arange(16) % 4
    for i, (lw, tw) in enumerate(zip(low.tolist(), top.tolist())):
        even, odd = _plane_codes(bits, torch.tensor(lw), torch.tensor(tw))
        word = lambda b: b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24  # noqa: E731
        got = [[r & 0xFFFF, r >> 16] for r in _run_ptx(c.value_lookup_asm, word(lw), word2=word(tw), lane=i % 32)]
        e, o = even.tolist(), odd.tolist()
        want = [[e[0], e[1]], [e[2], e[3]], [o[0], o[1]], [o[2], o[3]]]
        assert got == [[table[x] & 0xFFFF for x in pair] for pair in want], (lw, tw)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_plane_asm_matches_code_table(bits, head_dim):
    """On the GPU: the 2- and 3-bit lookup returns exactly the fp16 table value of both codes of every pair."""
    gen = torch.Generator().manual_seed(bits * 100 + head_dim)
    low = torch.randint(0, 256, (4096,), generator=gen, dtype=torch.uint8)
    top = torch.randint(0, 256, (4096,), generator=gen, dtype=torch.uint8)
    even = torch.full((4096,), float("nan"), dtype=torch.float16, device="cuda")
    odd = torch.full_like(even, float("nan"))
    c = _constants(bits, bits, head_dim, torch.device("cuda"))
    _decode_planes[(1,)](low.cuda(), top.cuda(), even, odd, ASM=c.value_lookup_asm, N=4096)
    table = Quantizer(bits, head_dim).code_values("cuda", torch.float16)
    code_even, code_odd = _plane_codes(bits, low.long(), top.long())
    assert torch.equal(even, table[code_even.cuda()]) and torch.equal(odd, table[code_odd.cuda()])


def test_no_byte_permute_lookup_for_5_bits():
    """16 magnitudes do not fit a byte permute's 8-byte pool: 5-bit codes take the table gathers."""
    assert _constants(5, 4, 128, torch.device("cpu")).key_lookup_asm == ""


def _int8_values(head_dim: int, device) -> torch.Tensor:
    """What each 4-bit key code means to the attention kernel: t with (t + 1/2) * step = its value."""
    c = _constants(4, 4, head_dim, torch.device(device))
    values = (c.key_int8.double().cpu() + 0.5) * c.key_int8_step
    # the fp32 table
    assert torch.allclose(values, Quantizer(4, head_dim).code_values("cpu", torch.float64), rtol=1e-7, atol=0)
    return c.key_int8


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_int8_asm_program_on_cpu(head_dim):
    """The int8 key lookup (emulated): 4 bytes -> coordinates 0..3 and 4..7 as the int8 of each code."""
    table = _int8_values(head_dim, "cpu").tolist()
    c = _constants(4, 4, head_dim, torch.device("cpu"))
    gen = torch.Generator().manual_seed(head_dim)
    words = [sum(((k + j) % 16) << 4 * j for j in range(8)) for k in range(16)]
    words += torch.randint(0, 2**32, (200,), generator=gen, dtype=torch.int64).tolist()
    for i, w in enumerate(words):
        got = [list(r.to_bytes(4, "little", signed=False))
               for r in _run_ptx(c.key_int8_asm, w, num_outputs=2, lane=i % 32)]
        want = [[table[w >> 4 * j & 15] & 0xFF for j in range(4)], [table[w >> 4 * j & 15] & 0xFF for j in range(4, 8)]]
        assert got == want, hex(w)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_int8_asm_matches_code_table(head_dim):
    """On the GPU: the int8 key lookup returns exactly the table's t of every 4-bit code, in natural order."""
    codes = torch.randint(0, 16, (512, 16), dtype=torch.int32, generator=torch.Generator().manual_seed(head_dim))
    codes[0] = torch.arange(16)
    packed = pack_codes(codes, 4).view(-1).cuda()
    a = torch.zeros(4096, dtype=torch.int8, device="cuda")
    b = torch.zeros_like(a)
    c = _constants(4, 4, head_dim, torch.device("cuda"))
    _decode_int8[(1,)](packed, a, b, ASM=c.key_int8_asm, N=4096)
    want = _int8_values(head_dim, "cuda")[codes.view(-1, 2, 4).cuda().long()]  # (words, coordinates 0..3 / 4..7)
    assert torch.equal(a.view(-1, 4), want[:, 0]) and torch.equal(b.view(-1, 4), want[:, 1])
