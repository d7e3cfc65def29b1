import numpy as np
import pytest

from turboquant_vllm.core.codebook import SUPPORTED_BITS, codebook, gaussian_limit_distortion, lloyd_max, shannon_bound

# The TurboQuant paper's table at d = 128 (exact sphere marginal) and the Gaussian-limit values.
EXACT_128 = {1: 0.3609, 2: 0.1160, 3: 0.03397, 4: 0.00931}
GAUSSIAN = {1: 0.3634, 2: 0.1175, 3: 0.03455, 4: 0.009501}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_distortion_matches_paper(bits):
    cb = lloyd_max(bits, 128)
    assert cb.distortion == pytest.approx(EXACT_128[bits], rel=2e-3)
    assert gaussian_limit_distortion(bits) == pytest.approx(GAUSSIAN[bits], rel=2e-3)
    assert shannon_bound(bits) < cb.distortion < gaussian_limit_distortion(bits)


@pytest.mark.parametrize("dim", [64, 80, 96, 112, 128, 256])
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_codebook_shape_and_order(bits, dim):
    cb = lloyd_max(bits, dim)
    assert cb.magnitudes.shape == (2 ** (bits - 1),)
    assert np.all(np.diff(cb.magnitudes) > 0) and cb.magnitudes[0] > 0
    assert np.all((cb.boundaries > cb.magnitudes[:-1]) & (cb.boundaries < cb.magnitudes[1:]))
    values = cb.signed_values()
    assert np.allclose(values[: 2 ** (bits - 1)], -values[2 ** (bits - 1) :])


def test_lloyd_max_fixed_point():
    # Each magnitude is the conditional mean of its cell: resampling the marginal agrees.
    cb = lloyd_max(3, 64)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200_000, 64))
    t = np.abs(x[:, 0] / np.linalg.norm(x, axis=1))
    cell = np.searchsorted(cb.boundaries, t)
    means = np.array([t[cell == i].mean() for i in range(4)])
    assert np.allclose(means, cb.magnitudes, rtol=1e-2)


def test_deterministic_and_cached():
    assert lloyd_max(4, 128) is lloyd_max(4, 128)


@pytest.mark.parametrize("bits,dim", [(0, 128), (6, 128), (4, 2)])
def test_bad_input(bits, dim):
    with pytest.raises(ValueError, match="bits|head_dim"):
        lloyd_max(bits, dim)


@pytest.mark.parametrize("dim", [64, 80, 96, 128, 256])
def test_shipped_4bit_codebook_is_on_an_int8_grid(dim):
    """4-bit magnitudes are exactly (t + 1/2) * step with integer t in [0, 127], at < 0.1% more distortion."""
    cb, optimum = codebook(4, dim), lloyd_max(4, dim)
    t = np.array(cb.int8_table())
    assert np.all((t >= 0) & (t <= 127)) and np.all(np.diff(t) > 0)
    assert np.array_equal(cb.magnitudes, (t + 0.5) * cb.int8_step)
    assert np.allclose(cb.boundaries, 0.5 * (cb.magnitudes[1:] + cb.magnitudes[:-1]))
    assert optimum.distortion < cb.distortion < 1.001 * optimum.distortion
    # The distortion formula agrees with sampling the marginal.
    rng = np.random.default_rng(dim)
    x = rng.standard_normal((100_000, dim))
    y = np.abs(x[:, 0] / np.linalg.norm(x, axis=1))
    err = (y - cb.magnitudes[np.searchsorted(cb.boundaries, y)]) ** 2
    assert err.mean() == pytest.approx(cb.mse_per_coord, rel=0.02)


@pytest.mark.parametrize("bits", [b for b in SUPPORTED_BITS if b != 4])
def test_other_codebooks_are_lloyd_max(bits):
    assert codebook(bits, 128) is lloyd_max(bits, 128)
    with pytest.raises(ValueError, match="not on an int8 grid"):
        codebook(bits, 128).int8_table()
