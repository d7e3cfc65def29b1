"""benchmarks.quality_transform_bound: the bounds are the minima they claim to be."""

import torch

from benchmarks import quality_transform_bound as qtb


def spd(gen: torch.Generator, d: int) -> torch.Tensor:
    a = torch.randn(d, d, generator=gen, dtype=torch.float64)
    return a @ a.T / d + 0.1 * torch.eye(d, dtype=torch.float64)


def error(m: torch.Tensor, cov: torch.Tensor, weight: torch.Tensor) -> float:
    return (torch.trace(m @ cov) * torch.trace(torch.linalg.inv(m) @ weight)).item()


def test_bounds_are_attained_and_never_beaten():
    gen = torch.Generator().manual_seed(0)
    cov, weight = spd(gen, 12), spd(gen, 12)
    none, diag, full = qtb.bounds(cov, weight)
    assert full <= diag <= none
    assert abs(error(torch.eye(12, dtype=torch.float64), cov, weight) - none) < 1e-9 * none
    # the best diagonal: M_cc = sqrt(weight_cc / cov_cc)
    assert abs(error(torch.diag((torch.diag(weight) / torch.diag(cov)).sqrt()), cov, weight) - diag) < 1e-9 * diag
    # the best matrix: the geometric mean of cov^-1 and weight
    r = qtb.sqrtm(cov)
    r_inv = torch.linalg.inv(r)
    best = r_inv @ qtb.sqrtm(r @ weight @ r) @ r_inv
    assert abs(error(best, cov, weight) - full) < 1e-8 * full
    for _ in range(20):  # no other transform does better
        assert error(spd(gen, 12), cov, weight) >= full * (1 - 1e-9)


def test_diagonal_inputs_need_no_matrix():
    cov = torch.diag(torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64))
    weight = torch.diag(torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64))
    _, diag, full = qtb.bounds(cov, weight)
    assert abs(diag - full) < 1e-9 * diag
