"""quant.quartet2.kernels.dequantize: the Triton decoder of NVFP4 codes and scales (natively on a GPU, in Triton's
interpreter on the CPU) bit for bit against naive.unscaled_values, and the emulation's exact products against
float64."""

import pytest
import torch

from tests.conftest import DEVICE
from turboquant_vllm.quant.quartet2 import nvfp4
from turboquant_vllm.quant.quartet2.kernels import dequantize
from turboquant_vllm.quant.quartet2.kernels.dequantize.naive import unscaled_values


def random_nvfp4(rows, k, seed):
    """Every code, and E4M3 scales over their whole range: subnormals, zero, 448."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 0x7F, (rows, k // 16), generator=gen, dtype=torch.uint8)
    scales.view(-1)[:3] = torch.tensor([0, 1, 0x7E], dtype=torch.uint8)  # zero, the smallest subnormal, 448
    return packed.to(DEVICE), scales.view(torch.float8_e4m3fn).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(37, 48), (16, 128), (5, 272)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_decoder_is_the_reference_bit_for_bit(shape, dtype):
    rows, k = shape
    packed, scales = random_nvfp4(rows, k, rows * k)
    out = torch.full((rows, k), float("nan"), dtype=dtype, device=DEVICE)  # poisoned
    got = dequantize.values_triton(packed, scales, out)
    want = unscaled_values(packed, scales)
    assert not got.isnan().any() and torch.equal(got.float(), want)
    assert torch.equal(want.to(dtype).float(), want)  # exact in every dtype
    with pytest.raises(ValueError, match="do not fit"):
        dequantize.values_triton(packed, scales, out[:, :16])


def test_exact_products_sum_exact_products():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 160, generator=gen) * 3).to(DEVICE)
    w = (torch.randn(48, 160, generator=gen) * 0.05).to(DEVICE)
    xq, wq = nvfp4.quantize(x, per_row=True), nvfp4.quantize(w)
    xp, wp = nvfp4.pack(xq.codes), nvfp4.pack(wq.codes)
    got = dequantize.exact_products(xp, xq.scales, wp, wq.scales)
    xv, wv = unscaled_values(xp, xq.scales).double(), unscaled_values(wp, wq.scales).double()
    want = xv @ wv.t()
    assert got.dtype == torch.float32 and got.shape == (7, 48)
    # fp32 sums of exact products: within the sums' rounding
    assert ((got.double() - want).abs() <= 2**-21 * (xv.abs() @ wv.abs().t())).all()
