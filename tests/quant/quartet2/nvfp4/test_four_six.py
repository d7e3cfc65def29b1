"""Quartet II's NVFP4 quantizer (quant.quartet2.nvfp4.four_six) against first principles: the 4/6 choice by
exhaustive error over brute-force nearest E2M1 values, E4M3 scales in range; zeros, subnormals, huge values."""

import pytest
import torch

from tests.quant.quartet2.nvfp4.test_format import brute_force_e2m1
from turboquant_vllm.quant.quartet2 import nvfp4


@pytest.mark.parametrize("shape", [(1, 16), (7, 48), (3, 5, 64)])
def test_the_4_6_choice_is_the_smaller_error(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen) * torch.exp(torch.randn(*shape[:-1], 1, generator=gen))
    x[..., 3] *= 20  # groups with an outlier, where mapping the max to 4 clips it
    q = nvfp4.quantize(x)
    assert q.codes.dtype == torch.uint8 and q.scales.dtype == torch.float8_e4m3fn
    assert q.scales.shape == (*shape[:-1], shape[-1] // 16)
    ts = x.abs().amax() * (1 / 256) * torch.tensor(1 / 6)  # Quartet II's order of multiplication
    assert torch.equal(q.tensor_scale, ts)
    torch.testing.assert_close(ts, x.abs().amax() / 1536)
    units = (x / ts).reshape(*shape[:-1], -1, 16)
    errs = []
    for target in (6.0, 4.0):  # both choices from first principles
        scale = (x.reshape(units.shape).abs().amax(-1) * torch.tensor(1 / target) / ts).to(torch.float8_e4m3fn).float()
        codes = brute_force_e2m1((units / scale[..., None]).flatten()).view(units.shape)
        errs.append(((nvfp4.e2m1_value(codes) * scale[..., None] - units) ** 2).sum(-1))
    chose_6 = q.scales.float() == (x.reshape(units.shape).abs().amax(-1) * torch.tensor(1 / 6) / ts).to(
        torch.float8_e4m3fn).float()
    assert (torch.where(chose_6, errs[0], errs[1]) <= torch.minimum(errs[0], errs[1])).all()
    if chose_6.numel() >= 8:
        assert chose_6.any() and (~chose_6).any()  # both rules win somewhere
    assert q.scales.float().max() <= 384.0
    rel = (nvfp4.dequantize(q) - x).norm() / x.norm()
    assert rel < 0.12


def test_zeros_subnormals_and_huge_values_stay_finite():
    zeros = nvfp4.quantize(torch.zeros(2, 32))
    assert not zeros.codes.any() and not zeros.scales.float().any() and not nvfp4.dequantize(zeros).any()
    assert zeros.tensor_scale.item() == 1.0  # as Quartet II sets it
    for magnitude in (1e-40, 1e38):  # fp32 subnormals; near fp32's largest
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1)) * magnitude
        q = nvfp4.quantize(x)
        back = nvfp4.dequantize(q)
        assert torch.isfinite(back).all() and torch.isfinite(q.scales.float()).all()
        if magnitude > 1:  # (the norms of x itself would overflow: compare in units of the magnitude)
            assert ((back - x) / magnitude).norm() / (x / magnitude).norm() < 0.12


def test_a_given_tensor_scale():
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(2))
    q = nvfp4.quantize(x, tensor_scale=torch.tensor(0.01))
    assert q.tensor_scale.item() == pytest.approx(0.01)
    assert (nvfp4.dequantize(q) - x).norm() / x.norm() < 0.12
    own = nvfp4.quantize(x, tensor_scale=nvfp4.tensor_scale_of(x))  # the one it would compute: the same codes
    default = nvfp4.quantize(x)
    assert torch.equal(own.codes, default.codes) and torch.equal(own.scales.view(torch.uint8),
                                                                 default.scales.view(torch.uint8))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="groups of 16"):
        nvfp4.quantize(torch.zeros(2, 24))
    for bad in (float("nan"), float("inf")):
        x = torch.zeros(1, 16)
        x[0, 5] = bad
        with pytest.raises(ValueError, match="NaN or inf"):
            nvfp4.quantize(x)
