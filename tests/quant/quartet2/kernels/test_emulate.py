"""quartet2's exact W4A4 emulation (quant.quartet2.kernels.emulate) against its plain-PyTorch reference (naive.py: the
activations quantized per row by nvfp4.quantize, both operands dequantized and multiplied in float64); a row's output
independent of its batch; a weight's quantization (kernels.quantize.quantize_weight, quantize_parts)."""

import pytest
import torch

from tests.conftest import DEVICE
from turboquant_vllm.quant.quartet2 import nvfp4
from turboquant_vllm.quant.quartet2.kernels.dequantize.naive import unscaled_values
from turboquant_vllm.quant.quartet2.kernels.emulate import emulated_linear
from turboquant_vllm.quant.quartet2.kernels.emulate.naive import w4a4_reference
from turboquant_vllm.quant.quartet2.kernels.quantize import quantize_parts, quantize_weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_the_reference(dtype):
    gen = torch.Generator().manual_seed(int(dtype.itemsize))
    m, k, n = 7, 16 * 9, 24
    x = (torch.randn(3, m, k, generator=gen) * 2).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    wq = quantize_weight(w.to(DEVICE))
    y = emulated_linear(x.to(DEVICE), wq, bias.to(DEVICE))
    assert y.shape == (3, m, n) and y.dtype == dtype and not y.isnan().any()
    ref_w = nvfp4.quantize(w.float())  # the weight by the reference quantizer (the kernel's is tested bit for bit)
    want = w4a4_reference(x, nvfp4.NVFP4Weight(nvfp4.pack(ref_w.codes), ref_w.scales, ref_w.tensor_scale), bias)
    # the sums' order is the only difference; then the cast to the activations' dtype
    tol = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(y.cpu().double(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_values_are_exact_in_bf16_and_the_weight_is_a_quarter():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(32, 256, generator=gen).to(DEVICE)
    wq = quantize_weight(w)
    v32 = unscaled_values(wq.packed, wq.scales)
    assert torch.equal(v32, unscaled_values(wq.packed, wq.scales, torch.bfloat16).float())
    ref = nvfp4.quantize(w.cpu())
    # the reference multiplies code * (scale * tensor scale): one rounding apart
    torch.testing.assert_close((v32 * wq.tensor_scale).cpu(), nvfp4.dequantize(ref), rtol=2.5e-7, atol=0)
    assert wq.nbytes == 32 * (128 + 16) + 4  # vs 32 * 512 bytes in bf16: 0.28x


def test_a_row_does_not_depend_on_its_batch():
    gen = torch.Generator().manual_seed(6)
    w = quantize_weight(torch.randn(16, 64, generator=gen).to(DEVICE))
    x = torch.randn(5, 64, generator=gen).to(DEVICE)
    x[0] *= 1000  # a loud neighbour: a batch-wide activation scale would coarsen every other row
    alone = emulated_linear(x[3:4], w)
    together = emulated_linear(x, w)[3:4]
    assert torch.equal(alone, together)


def test_fused_parts_keep_a_tensor_scale_each():
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(32, 64, generator=gen) * 0.05, torch.randn(16, 64, generator=gen) * 2.0  # scales 40x apart
    fused = quantize_parts(torch.cat([q, k]).to(DEVICE), [32, 16])
    alone = [quantize_weight(t.to(DEVICE)) for t in (q, k)]
    assert torch.equal(fused.packed, torch.cat([a.packed for a in alone]))
    assert torch.equal(fused.scales.view(torch.uint8), torch.cat([a.scales for a in alone]).view(torch.uint8))
    rows = torch.cat([alone[0].tensor_scale.expand(32), alone[1].tensor_scale.expand(16)])
    assert torch.equal(fused.tensor_scale, rows)
    one = quantize_parts(q.to(DEVICE), [32])  # one part: quantize_weight's scalar scale
    assert one.tensor_scale.dim() == 0 and torch.equal(one.packed, alone[0].packed)
