import numpy as np

from benchmarks import codebook_polynomial as cp
from turboquant_vllm.core.codebook import codebook, lloyd_max


def test_fp16_magnitudes_follow_the_kernels_rounding_order():
    assert np.array_equal(cp.fp16_magnitudes(np.array([0.0]), 8), np.arange(8) + 0.5)
    c3, c5 = 3e-4, 1.1e-4
    h = np.float16
    want = []
    for j in range(8):
        x = h(j + 0.5)
        x2 = h(x * x)
        p = h(h(h(h(c5) * x2) + h(c3)) * x2)  # (c5 x2 + c3) x2, each step in fp16
        want.append(float(h(h(p + h(1.0)) * x)))
    assert np.allclose(cp.fp16_magnitudes(np.array([c3, c5]), 8), want, rtol=0, atol=0)


def test_a_quintic_fits_the_value_codebook_closer_than_a_cubic():
    used = codebook(4, 128).mse_per_coord
    cubic, quintic = cp.fit(4, 128, 1), cp.fit(4, 128, 2)
    assert quintic[0] <= cubic[0] < 1.05 * used
    assert lloyd_max(4, 128).mse_per_coord <= quintic[0]  # Lloyd-Max is the optimum over all codebooks
    assert quintic[2] > 0 and np.all(np.isfinite(quintic[1]))
