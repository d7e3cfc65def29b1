"""quartet2's exact NVFP4 emulation (quant.quartet2.linear) against the plain-PyTorch reference: both operands
quantized by nvfp4.quantize, dequantized and multiplied in float64; a row's output independent of its batch."""

import pytest
import torch

from tests.conftest import DEVICE
from turboquant_vllm.quant.quartet2 import linear, nvfp4


def reference(x, w, bias=None):
    xq = nvfp4.quantize(x.float(), per_row=True)
    wq = nvfp4.quantize(w.float())
    y = nvfp4.dequantize(xq).double() @ nvfp4.dequantize(wq).double().t()
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_the_reference(dtype):
    gen = torch.Generator().manual_seed(int(dtype.itemsize))
    m, k, n = 7, 16 * 9, 24
    x = (torch.randn(3, m, k, generator=gen) * 2).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    wq = linear.quantize_weight(w.to(DEVICE))
    y = linear.emulated_linear(x.to(DEVICE), wq, bias.to(DEVICE))
    assert y.shape == (3, m, n) and y.dtype == dtype and not y.isnan().any()
    want = reference(x.reshape(-1, k), w, bias).reshape(3, m, n)
    # the sums' order is the only difference; then the cast to the activations' dtype
    tol = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(y.cpu().double(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_values_are_exact_in_bf16_and_the_weight_is_a_quarter():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(32, 256, generator=gen).to(DEVICE)
    wq = linear.quantize_weight(w)
    v32 = linear.unscaled_values(wq.packed, wq.scales)
    assert torch.equal(v32, linear.unscaled_values(wq.packed, wq.scales, torch.bfloat16).float())
    ref = nvfp4.quantize(w.cpu())
    # the reference multiplies code * (scale * tensor scale): one rounding apart
    torch.testing.assert_close((v32 * wq.tensor_scale).cpu(), nvfp4.dequantize(ref), rtol=2.5e-7, atol=0)
    assert wq.nbytes == 32 * (128 + 16) + 4  # vs 32 * 512 bytes in bf16: 0.28x


def test_a_row_does_not_depend_on_its_batch():
    gen = torch.Generator().manual_seed(6)
    w = linear.quantize_weight(torch.randn(16, 64, generator=gen).to(DEVICE))
    x = torch.randn(5, 64, generator=gen).to(DEVICE)
    x[0] *= 1000  # a loud neighbour: a batch-wide activation scale would coarsen every other row
    alone = linear.emulated_linear(x[3:4], w)
    together = linear.emulated_linear(x, w)[3:4]
    assert torch.equal(alone, together)


def test_fused_parts_keep_a_tensor_scale_each():
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(32, 64, generator=gen) * 0.05, torch.randn(16, 64, generator=gen) * 2.0  # scales 40x apart
    fused = linear.quantize_parts(torch.cat([q, k]).to(DEVICE), [32, 16])
    alone = [linear.quantize_weight(t.to(DEVICE)) for t in (q, k)]
    assert torch.equal(fused.packed, torch.cat([a.packed for a in alone]))
    assert torch.equal(fused.scales.view(torch.uint8), torch.cat([a.scales for a in alone]).view(torch.uint8))
    rows = torch.cat([alone[0].tensor_scale.expand(32), alone[1].tensor_scale.expand(16)])
    assert torch.equal(fused.tensor_scale, rows)
    one = linear.quantize_parts(q.to(DEVICE), [32])  # one part: quantize_weight's scalar scale
    assert one.tensor_scale.dim() == 0 and torch.equal(one.packed, alone[0].packed)
