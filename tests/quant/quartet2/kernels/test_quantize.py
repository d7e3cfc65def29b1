"""The NVFP4 quantize kernel (quant.quartet2.kernels.quantize) against its plain-PyTorch reference (naive.py):
bit-exact codes, scales and tensor scales on fresh random inputs of odd sizes, every input dtype, one tensor scale
or one per row, outputs poisoned first; zeros, subnormals, huge values; bad input refused."""

import pytest
import torch

from tests.conftest import DEVICE
from turboquant_vllm.quant.quartet2.kernels.quantize import quantize
from turboquant_vllm.quant.quartet2.kernels.quantize.naive import quantize_reference


def poisoned(m, k):
    return (torch.full((m, k // 2), 0xAB, dtype=torch.uint8, device=DEVICE),
            torch.full((m, k // 16), 0x7F, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn))


def check(x, **kw):
    m, k = x.shape
    packed, scales = poisoned(m, k)
    got = quantize(x.to(DEVICE), packed=packed, scales=scales, **kw)
    want = quantize_reference(x, **kw)
    assert torch.equal(got[0].cpu(), want[0])
    assert torch.equal(got[1].view(torch.uint8).cpu(), want[1].view(torch.uint8))
    assert torch.equal(got[2].cpu(), want[2])
    assert not torch.isnan(got[1].float()).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_bit_exact_to_the_reference(dtype, per_row, seed):
    gen = torch.Generator().manual_seed(seed * 7 + per_row)
    m = int(torch.randint(1, 40, (1,), generator=gen))
    k = 16 * int(torch.randint(1, 13, (1,), generator=gen))
    x = torch.randn(m, k, generator=gen) * torch.exp(torch.randn(m, 1, generator=gen) * 2)
    x[:, int(torch.randint(0, k, (1,), generator=gen))] *= 25  # an outlier column: 4 clips it, 6 keeps it
    check(x.to(dtype), per_row=per_row)


def test_zero_rows_subnormals_huge_values_and_a_given_scale():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 48, generator=gen)
    x[2] = 0  # an all-zero row: scale 0, codes 0 (and tensor scale 1 per row)
    x[4, :16] = 0  # an all-zero group
    x[5] *= 1e-41  # fp32 subnormals
    x[6] *= 1e37
    for per_row in (False, True):
        check(x, per_row=per_row)
    check(x[:3], tensor_scale=torch.tensor(0.01))
    check(torch.zeros(3, 32))


def test_many_rows_and_groups_past_one_block():
    gen = torch.Generator().manual_seed(4)
    check(torch.randn(35, 16 * 19, generator=gen), per_row=True)  # 3 row blocks of 16, 3 group blocks of 8


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_few_rows_split_along_k(rows):
    """A decode step's few rows: K split across programs (each reading its rows' amax in full), the same bits."""
    gen = torch.Generator().manual_seed(5 + rows)
    x = torch.randn(rows, 16 * 150, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen))
    x[:, 7] *= 40
    check(x, per_row=True)
    check(x.to(torch.bfloat16), per_row=False)
    check(x, tensor_scale=x.abs().max() / 1000)  # at least amax / 1536, as a weight's is


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize(torch.zeros(2, 24, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous along K"):
        quantize(torch.zeros(32, 2, device=DEVICE).t())
    x = torch.zeros(1, 16, device=DEVICE)
    x[0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize(x)
    with pytest.raises(ValueError, match="packed must be"):
        quantize(torch.zeros(2, 32, device=DEVICE), packed=torch.empty(2, 8, dtype=torch.uint8, device=DEVICE))
    p, s, ts = quantize(torch.zeros(0, 32, device=DEVICE), per_row=True)
    assert p.shape == (0, 16) and s.shape == (0, 2) and ts.shape == (0, 1)
