import pytest
import torch
import triton
import triton.language as tl

from turboquant_vllm.core.packing import pack_codes
from turboquant_vllm.core.quantizer import Quantizer
from turboquant_vllm.kernels.constants import _constants


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
    _decode[(1,)](packed, even, odd, ASM=c.nibble_asm, N=4096)
    table = Quantizer(4, head_dim).code_values("cuda", torch.float16)
    assert torch.equal(even, table[codes[:, 0].cuda().long()])
    assert torch.equal(odd, table[codes[:, 1].cuda().long()])
