import pytest
import torch

from turboquant_vllm.core.codebook import SUPPORTED_BITS
from turboquant_vllm.core.packing import pack_codes, record_bytes, unpack_codes


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("dim", [64, 80, 96, 112, 128, 256])
def test_roundtrip_and_size(bits, dim):
    gen = torch.Generator().manual_seed(bits * 1000 + dim)
    codes = torch.randint(0, 2**bits, (7, 3, dim), generator=gen, dtype=torch.int32)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (7, 3, dim * bits // 8) == (7, 3, record_bytes(dim, bits))
    assert torch.equal(unpack_codes(packed, bits, dim), codes)


def test_layout_4bit_3bit_and_5bit():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]], dtype=torch.int32)
    assert pack_codes(codes, 4).tolist() == [[0x21, 0x43, 0x65, 0x07]]
    # 3 bits: low-2-bit plane (4 codes a byte) then the top-bit plane (8 a byte): 8 codes in 3 bytes
    lo = [1 | 2 << 2 | 3 << 4 | 0 << 6, 1 | 2 << 2 | 3 << 4 | 0 << 6]
    hi = [0b01111000]
    assert pack_codes(codes, 3).tolist() == [lo + hi]
    # 5 bits: the low-4-bit plane (the 4-bit layout) then the top-bit plane: 8 codes in 5 bytes
    codes = torch.tensor([[17, 2, 31, 4, 5, 6, 7, 16]], dtype=torch.int32)
    assert pack_codes(codes, 5).tolist() == [[0x21, 0x4F, 0x65, 0x07, 0b10000101]]


def test_planes_are_byte_sliced_over_groups_of_8():
    """2- and 3-bit planes: byte r of every group of 8 coordinates, then byte r + 1 (kernels.common.pair_index)."""
    low2 = [0, 1, 2, 3, 1, 2, 3, 0, 2, 3, 0, 1, 3, 0, 1, 2]  # two groups of 8 coordinates
    byte = lambda c: c[0] | c[1] << 2 | c[2] << 4 | c[3] << 6  # noqa: E731
    natural = [byte(low2[i : i + 4]) for i in range(0, 16, 4)]  # group 0: bytes 0, 1; group 1: bytes 2, 3
    sliced = [natural[0], natural[2], natural[1], natural[3]]
    assert len(set(natural)) == 4
    assert pack_codes(torch.tensor([low2]), 2).tolist() == [sliced]
    codes = torch.tensor([low2]) | torch.tensor([[0] * 8 + [4] * 8])  # 3 bits: group 1's top bits set
    assert pack_codes(codes, 3).tolist() == [sliced + [0, 0xFF]]  # one top-plane byte a group: in order
    assert pack_codes(torch.tensor([low2]), 4).tolist()[0][:2] == [0x10, 0x32]  # 4 bits: natural order


def test_bad_dim():
    with pytest.raises(ValueError, match="multiple of 8"):
        record_bytes(100, 4)
    with pytest.raises(ValueError, match="bits"):
        record_bytes(128, 6)
