"""Lloyd-Max codebooks for one coordinate of a uniformly random unit vector in R^d.

The exact marginal of such a coordinate has density proportional to (1 - t^2)^((d-3)/2) on
[-1, 1]; its CDF is a regularized incomplete beta function, so every Lloyd-Max step (interval
masses and conditional means) is computed in closed form, not by sampling or quadrature.

Codes are sign-magnitude: bit (bits-1) is the sign, the low bits index the magnitude table in
ascending order. The marginal is symmetric, so the codebook is too, and a kernel only needs the
2^(bits-1) magnitudes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from scipy import special

SUPPORTED_BITS = (1, 2, 3, 4, 5)


def _check(bits: int, dim: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if dim < 3:
        raise ValueError(f"head_dim must be >= 3 for the sphere marginal, got {dim}")


def _cdf(t: np.ndarray, dim: int) -> np.ndarray:
    """P(T <= t) for one coordinate T of a uniform unit vector in R^dim."""
    half = 0.5 * special.betainc(0.5, 0.5 * (dim - 1), np.clip(t * t, 0.0, 1.0))
    return 0.5 + np.sign(t) * half


def _first_moment(lo: np.ndarray, hi: np.ndarray, dim: int) -> np.ndarray:
    """Integral of t * density(t) over [lo, hi], in closed form."""
    a = 0.5 * (dim - 1)  # (1 - t^2)^(a) antiderivative exponent: density exponent + 1
    # normalizer of the density: 1 / B(1/2, (d-1)/2)
    norm = 1.0 / special.beta(0.5, 0.5 * (dim - 1))
    prim = lambda t: -np.power(np.clip(1.0 - t * t, 0.0, 1.0), a) / (2.0 * a)  # noqa: E731
    return norm * (prim(hi) - prim(lo))


@dataclass(frozen=True)
class Codebook:
    bits: int
    dim: int
    magnitudes: np.ndarray  # (2^(bits-1),) ascending, > 0
    boundaries: np.ndarray  # (2^(bits-1) - 1,) decision thresholds on |t| between magnitudes
    mse_per_coord: float  # E[(T - Q(T))^2] under the exact marginal
    int8_step: float = 0.0  # > 0: every magnitude is (t + 1/2) * int8_step for an integer t in [0, 127]

    @property
    def distortion(self) -> float:
        """Optimal E||y - Q(y)||^2 for a unit vector y: dim * per-coordinate MSE."""
        return self.dim * self.mse_per_coord

    def signed_values(self) -> np.ndarray:
        """Value of every code 0 .. 2^bits - 1 (sign-magnitude), as a lookup table."""
        return np.concatenate([self.magnitudes, -self.magnitudes])

    def int8_table(self) -> list[int]:
        """The magnitudes as the integers t of (t + 1/2) * int8_step (a codebook on the int8 grid only)."""
        if not self.int8_step:
            raise ValueError(f"the {self.bits}-bit codebook is not on an int8 grid")
        return [int(round(m / self.int8_step - 0.5)) for m in self.magnitudes]


@functools.lru_cache(maxsize=None)
def lloyd_max(bits: int, dim: int, iters: int = 2000, tol: float = 1e-15) -> Codebook:
    """Lloyd-Max quantizer of the exact sphere marginal; deterministic and cached."""
    _check(bits, dim)
    levels = 2 ** (bits - 1)  # magnitudes on the positive half
    # Start from the Gaussian-limit quantiles of |T|, T ~ N(0, 1/d).
    sigma = 1.0 / np.sqrt(dim)
    mags = sigma * special.ndtri(0.5 + 0.5 * (np.arange(levels) + 0.5) / levels)
    for _ in range(iters):
        edges = np.concatenate([[0.0], 0.5 * (mags[1:] + mags[:-1]), [1.0]])
        mass = _cdf(edges[1:], dim) - _cdf(edges[:-1], dim)
        new = _first_moment(edges[:-1], edges[1:], dim) / mass
        done = np.max(np.abs(new - mags)) < tol * sigma
        mags = new
        if done:
            break
    edges = np.concatenate([[0.0], 0.5 * (mags[1:] + mags[:-1]), [1.0]])
    mass = _cdf(edges[1:], dim) - _cdf(edges[:-1], dim)  # one side; both sides: 2 * mass
    # E[T^2] = 1/d; for centroid (conditional-mean) quantizers E[(T-Q)^2] = E[T^2] - E[Q^2].
    mse = 1.0 / dim - 2.0 * float(np.sum(mags * mags * mass))
    return Codebook(bits, dim, mags, 0.5 * (mags[1:] + mags[:-1]), mse)


def distortion_per_coord(mags: np.ndarray, dim: int) -> float:
    """E[(T - Q(T))^2] for magnitudes mags with nearest-magnitude cells, under the exact marginal."""
    edges = np.concatenate([[0.0], 0.5 * (mags[1:] + mags[:-1]), [1.0]])
    mass = _cdf(edges[1:], dim) - _cdf(edges[:-1], dim)
    first = _first_moment(edges[:-1], edges[1:], dim)
    return 1.0 / dim + 2.0 * float(np.sum(mags * mags * mass - 2.0 * mags * first))


@functools.lru_cache(maxsize=None)
def codebook(bits: int, dim: int) -> Codebook:
    """The codebook the package quantizes with: Lloyd-Max, except that the 4-bit magnitudes are moved
    onto the int8 grid (t + 1/2) * step, the step chosen to cost the least distortion. The attention
    kernel then multiplies queries with 4-bit keys as an exact int8 MMA (ops.utils.nibble_int8_asm);
    the move costs < 0.1% of the distortion (tests/core/test_codebook.py)."""
    cb = lloyd_max(bits, dim)
    if bits != 4:
        return cb
    best = None
    for top in np.linspace(64.5, 127.5, 2521):  # candidate steps: the largest magnitude is `top` steps
        step = cb.magnitudes[-1] / top
        mags = (np.clip(np.round(cb.magnitudes / step - 0.5), 0, 127) + 0.5) * step
        if np.all(np.diff(mags) > 0):
            mse = distortion_per_coord(mags, dim)
            if best is None or mse < best[0]:
                best = (mse, step, mags)
    mse, step, mags = best
    return Codebook(bits, dim, mags, 0.5 * (mags[1:] + mags[:-1]), mse, float(step))


def gaussian_limit_distortion(bits: int) -> float:
    """Lloyd-Max distortion of N(0, 1) at `bits` (the d -> infinity limit of Codebook.distortion)."""
    return lloyd_max(bits, 1_000_000).distortion


def shannon_bound(bits: int) -> float:
    """Rate-distortion lower bound 4^-bits for a unit vector."""
    return 4.0 ** (-bits)
