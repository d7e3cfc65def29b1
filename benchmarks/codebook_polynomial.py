"""Could the decode kernel compute its value codebook on the FMA pipe? The magnitudes as an odd polynomial of the code.

The decode kernel turns each value code into its magnitude with table lookups (PRMT: the integer pipe, the one that
bounds it, docs/performance.md). An odd polynomial p(x) = x (1 + c3 x^2 + c5 x^4) of x = j + 1/2 (j the magnitude
index) runs in fp16 as HFMA2 instead, two values an instruction. A global scale costs nothing (the cache stores
||v|| / ||codebook[codes]||), so the encoder quantizes to s p(x) and the kernel computes p(x) alone. s, c3 (cubic)
and c5 (quintic) are chosen for the least distortion under the exact sphere marginal (nearest-magnitude cells), with
p evaluated in fp16 in the kernel's order. Printed per bits and head_dim: the distortion of Lloyd-Max, of the codebook
in use (core.codebook: the 4-bit one on the int8 grid), and of each polynomial, relative to the one in use.

    python -m benchmarks codebook_polynomial [--bits 3,4] [--head-dims 64,96,128,256]
Prints its findings after a provenance header (log: benchmarks/results/quality_diagnosis/).
"""

from __future__ import annotations

import numpy as np
from scipy import optimize

from turboquant_vllm.core.codebook import codebook, distortion_per_coord, lloyd_max

from . import common

NAME = "codebook_polynomial"
DEGREES = {"cubic": 1, "quintic": 2}  # name -> free coefficients beyond the linear one


def fp16_magnitudes(coeffs: np.ndarray, levels: int) -> np.ndarray:
    """p(j + 1/2), j < levels, in fp16 in the kernel's order: x2 = x x; Horner in x2 over coeffs (c3[, c5]), then
    times x; every product and every sum rounded to fp16 (HFMA2 rounds a product and its sum once)."""
    h = np.float16
    x = (np.arange(levels) + 0.5).astype(h)
    x2 = (x * x).astype(h)
    acc = np.full(levels, h(0.0))
    for c in coeffs[::-1]:  # (c5 x2 + c3) x2 + 1
        acc = (acc * x2 + h(c)).astype(h)
    acc = (acc * x2 + h(1.0)).astype(h)
    return (acc * x).astype(np.float64)


def fit(bits: int, dim: int, free: int) -> tuple[float, np.ndarray, float]:
    """The polynomial with `free` coefficients past the linear one of least distortion: (per-coordinate distortion,
    coefficients, encoder scale s)."""
    levels = 2 ** (bits - 1)
    target = lloyd_max(bits, dim).magnitudes
    x = np.arange(levels) + 0.5
    # start: least squares of the Lloyd-Max magnitudes over x * (1, x^2, x^4, ...), scaled to a1 = 1
    basis = np.stack([x ** (2 * k + 1) for k in range(free + 1)], 1)
    start = np.linalg.lstsq(basis, target, rcond=None)[0]

    def distortion(params: np.ndarray) -> float:
        mags = np.exp(params[0]) * fp16_magnitudes(params[1:], levels)
        if not np.all(np.isfinite(mags)) or np.any(np.diff(mags) <= 0) or mags[0] <= 0:
            return 1.0  # not an ascending positive codebook
        return distortion_per_coord(mags, dim)

    p0 = np.concatenate([[np.log(start[0])], start[1:] / start[0]])
    best = optimize.minimize(distortion, p0, method="Nelder-Mead",
                             options=dict(xatol=1e-10, fatol=1e-16, maxiter=20000, maxfev=40000))
    return float(best.fun), best.x[1:], float(np.exp(best.x[0]))


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--bits", default="3,4")
    ap.add_argument("--head-dims", default="64,96,128,256")
    args = ap.parse_args(argv)
    common.print_header(common.command_line(NAME, argv))
    print("| bits | head_dim | Lloyd-Max | in use | cubic | quintic | cubic c3 | quintic c3, c5 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for bits in map(int, args.bits.split(",")):
        for dim in map(int, args.head_dims.split(",")):
            used = codebook(bits, dim).mse_per_coord
            found = {name: fit(bits, dim, free) for name, free in DEGREES.items()}
            rel = {name: f"{d / used:.4f}" for name, (d, _, _) in found.items()}
            print(f"| {bits} | {dim} | {lloyd_max(bits, dim).mse_per_coord / used:.4f} | 1 ({used * dim:.5f}) | "
                  f"{rel['cubic']} | {rel['quintic']} | {found['cubic'][1][0]:.6g} | "
                  + ", ".join(f"{c:.6g}" for c in found["quintic"][1]) + " |")
    print("\nDistortion per coordinate relative to the codebook in use (its unit-vector distortion in brackets); "
          "the polynomials are evaluated in fp16.")


if __name__ == "__main__":
    main()
