import pytest
import torch

from turboquant_vllm.core.codebook import SUPPORTED_BITS, lloyd_max, shannon_bound
from turboquant_vllm.core.quantizer import Quantizer
from turboquant_vllm.core.rotation import rotation_matrix
from turboquant_vllm.core.selftest import distortion_table


@pytest.mark.parametrize("dim", [64, 80, 96, 112, 128, 256])
def test_rotation_orthogonal_and_deterministic(dim):
    r = rotation_matrix(dim)
    assert torch.allclose(r @ r.T, torch.eye(dim), atol=1e-5)
    assert torch.equal(r, rotation_matrix(dim, 0))
    assert not torch.allclose(r, rotation_matrix(dim, 1))


def test_distortion_table_within_2_percent_of_optimum():
    for row in distortion_table(dim=128, num_vectors=20000, seed=1):
        assert row["mse"] == pytest.approx(row["lloyd_max"], rel=0.02), row
        assert row["mse"] > shannon_bound(row["bits"])


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_quantize_shapes_norms_and_error(bits, dtype):
    q = Quantizer(bits, 96)
    x = (torch.randn(5, 4, 96, generator=torch.Generator().manual_seed(bits)) * 3).to(dtype)
    packed, norms = q.quantize(x)
    assert packed.shape == (5, 4, 96 * bits // 8) and packed.dtype == torch.uint8
    assert norms.dtype == torch.float32
    x_hat = q.dequantize(packed, norms)
    true_norms = torch.linalg.vector_norm(x.float(), dim=-1)
    # Norm correction: the reconstruction has exactly the vector's norm.
    torch.testing.assert_close(torch.linalg.vector_norm(x_hat, dim=-1), true_norms, rtol=1e-5, atol=0)
    rel = ((x.float() - x_hat) ** 2).sum(-1) / true_norms**2
    assert torch.isfinite(x_hat).all()
    assert rel.mean() < 1.5 * lloyd_max(bits, 96).distortion


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_norm_correction_only_rescales(bits):
    """Same codes either way; corrected norms = true norms / the unit reconstruction's norm."""
    x = torch.randn(300, 128, generator=torch.Generator().manual_seed(bits))
    plain, corrected = Quantizer(bits, 128, norm_correction=False), Quantizer(bits, 128)
    (codes_p, norms_p), (codes_c, norms_c) = plain.quantize(x), corrected.quantize(x)
    assert torch.equal(codes_p, codes_c)
    torch.testing.assert_close(norms_p, torch.linalg.vector_norm(x, dim=-1))
    shrink = norms_p / norms_c  # = ||value[codes]|| of the unit vector: E[shrink^2] = 1 - MSE
    assert (shrink**2).mean() == pytest.approx(1 - lloyd_max(bits, 128).distortion, abs=0.01)


def test_zero_vector_stays_zero():
    q = Quantizer(4, 64)
    x_hat = q.dequantize(*q.quantize(torch.zeros(2, 64)))
    assert torch.equal(x_hat, torch.zeros(2, 64))


def test_dim_mismatch():
    with pytest.raises(ValueError, match="dim 128"):
        Quantizer(4, 128).quantize(torch.zeros(3, 64))
