import torch

from benchmarks import rounding_sensitivity as rs


def test_flip_ulps_moves_the_asked_fraction_by_one_ulp():
    x = (torch.rand(200_000) + 1).to(torch.bfloat16).clamp(1.0078125, 1.9921875)  # one ulp: 2^-7
    y = rs.flip_ulps(x, 0.05, torch.Generator().manual_seed(0))
    moved = y != x
    assert 0.045 < moved.float().mean().item() < 0.055
    assert torch.equal((y.float() - x.float()).abs()[moved], torch.full((int(moved.sum()),), 2.0**-7))
    assert torch.equal(rs.flip_ulps(x, 0.0, torch.Generator()), x)


def test_first_difference():
    assert rs.first_difference(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3])) is None
    assert rs.first_difference(torch.tensor([1, 2, 3]), torch.tensor([1, 5, 3])) == 1
