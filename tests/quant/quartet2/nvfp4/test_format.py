"""The NVFP4 format (quant.quartet2.nvfp4.format) against first principles: E2M1 rounding against a brute-force
nearest value with ties to even, the values of every code, packing two codes a byte."""

import torch

from turboquant_vllm.quant.quartet2 import nvfp4

VALUES = torch.tensor(nvfp4.E2M1_VALUES)


def brute_force_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Nearest of the 8 magnitudes (6 past the end), ties to the even index (even mantissa), the sign kept."""
    a = y.abs().clamp(max=6.0)
    dist = (a[:, None] - VALUES[None, :]).abs()
    nearest = dist == dist.min(dim=1, keepdim=True).values
    # among equally near magnitudes (at most two), the even index
    index = torch.where(nearest.sum(dim=1) > 1, (nearest * (torch.arange(8) % 2 == 0)).float().argmax(dim=1),
                        nearest.float().argmax(dim=1)).to(torch.uint8)
    return index | ((y < 0) & (index > 0)).to(torch.uint8) << 3


def test_e2m1_rounding_matches_brute_force_with_ties_to_even():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    y = torch.cat([ties, -ties, torch.tensor(nvfp4.E2M1_VALUES), torch.tensor([7.0, 100.0, -0.0, 1e-30, -6.0001]),
                   torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 3])
    assert torch.equal(nvfp4.e2m1_round(y), brute_force_e2m1(y))
    assert nvfp4.e2m1_value(nvfp4.e2m1_round(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_codes_pack_two_a_byte_low_nibble_first():
    codes = torch.randint(0, 16, (3, 32), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    packed = nvfp4.pack(codes)
    assert packed.shape == (3, 16) and torch.equal(nvfp4.unpack(packed), codes)
    assert packed[0, 0].item() == codes[0, 0].item() | codes[0, 1].item() << 4
    assert nvfp4.e2m1_value(torch.arange(16, dtype=torch.uint8)).tolist() == [
        *nvfp4.E2M1_VALUES, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
