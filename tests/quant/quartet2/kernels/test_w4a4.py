"""quartet2's W4A4 path (quant.quartet2.kernels.w4a4) on the CPU: vLLM's CUTLASS NVFP4 GEMM replaced by its float64
reference (naive.py) behind the kernel's checks (shapes, dtypes, the swizzled 128 x 4 scale layout, one fp32 alpha, the
output rounded once to bf16 / fp16); the adapter's output against the exact emulation (kernels.emulate)."""

import pytest
import torch

from tests.conftest import DEVICE
from tests.quant.quartet2.plugin.layers import nvfp4_fused_layer, on_the_fly_layer
from turboquant_vllm.quant.quartet2 import nvfp4
from turboquant_vllm.quant.quartet2.kernels import w4a4
from turboquant_vllm.quant.quartet2.kernels.emulate import emulated_linear
from turboquant_vllm.quant.quartet2.kernels.quantize import quantize_parts, quantize_weight
from turboquant_vllm.quant.quartet2.kernels.w4a4.naive import cutlass_scaled_fp4_mm_reference
from turboquant_vllm.quant.quartet2.nvfp4.blocked import round_up, swizzle_scales
from turboquant_vllm.quant.quartet2.plugin import paths
from turboquant_vllm.quant.quartet2.plugin.config import Quartet2Config


def fake_cutlass_scaled_fp4_mm(a, b, block_scale_a, block_scale_b, alpha, out_dtype):
    """vllm._custom_ops.cutlass_scaled_fp4_mm: its checks (csrc/quantization/fp4), then its float64 reference."""
    assert a.dtype == b.dtype == torch.uint8 and a.dim() == b.dim() == 2 and a.shape[1] == b.shape[1]
    assert block_scale_a.dtype == block_scale_b.dtype == torch.float8_e4m3fn
    assert alpha.dtype == torch.float32 and alpha.numel() == 1 and out_dtype in (torch.bfloat16, torch.float16)
    assert all(t.is_contiguous() for t in (a, b, block_scale_a, block_scale_b, alpha))
    (m, half), n = a.shape, b.shape[0]
    k = 2 * half
    assert k % 32 == 0 and n % 32 == 0, (k, n)
    assert tuple(block_scale_a.shape) == (round_up(m, 128), round_up(k // 16, 4)), block_scale_a.shape
    assert tuple(block_scale_b.shape) == (round_up(n, 128), round_up(k // 16, 4)), block_scale_b.shape
    return cutlass_scaled_fp4_mm_reference(a, b, block_scale_a, block_scale_b, alpha, out_dtype)


@pytest.fixture
def fake_kernel(monkeypatch):
    from vllm import _custom_ops as ops

    calls = []

    def kernel(*args):
        calls.append(args)
        return fake_cutlass_scaled_fp4_mm(*args)

    monkeypatch.setattr(ops, "cutlass_scaled_fp4_mm", kernel)
    return calls


def test_the_kernels_reference_is_the_product_of_the_dequantized_operands():
    """On operands quantized by the reference quantizer, odd sizes: float64 sums of code x scale products."""
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(5, 80, generator=gen), torch.randn(40, 80, generator=gen)
    xq, wq = nvfp4.quantize(x, tensor_scale=torch.tensor(1.0)), nvfp4.quantize(w, tensor_scale=torch.tensor(1.0))
    out = cutlass_scaled_fp4_mm_reference(nvfp4.pack(xq.codes), nvfp4.pack(wq.codes), swizzle_scales(xq.scales),
                                          swizzle_scales(wq.scales), torch.tensor([0.5]), torch.bfloat16)
    assert out.shape == (5, 40) and not out.isnan().any()
    want = (nvfp4.dequantize(xq).double() @ nvfp4.dequantize(wq).double().t() * 0.5).to(torch.bfloat16)
    assert torch.equal(out, want)


def check_close(y, want, dtype, bias=None):
    """Two roundings to dtype (the kernel's, then the scales') against the emulation's one: within one unit in the
    last place (relative to the product before the bias), and most outputs equal (about 3 in 4 here): a scale off by
    a part in 2,000 fails the fp16 cases."""
    eps = torch.finfo(dtype).eps
    scale = (want.double() - (0 if bias is None else bias.double())).abs().max().item()
    torch.testing.assert_close(y.double(), want.double(), rtol=eps, atol=eps * scale)
    assert (y == want).double().mean() > 0.6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k, parts", [(96, 144, None), (40, 80, None), (48, 128, [32, 16])])
def test_the_adapter_is_the_emulation(fake_kernel, dtype, n, k, parts):
    """K and N padded to the kernel's 32, activations per row, fused parts with their own tensor scales."""
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) * 0.05)
    if parts:
        w[parts[0]:] *= 20  # the second part's tensor scale 20x the first's
    wq = quantize_parts(w.to(dtype).to(DEVICE), parts or [n])
    prepared = w4a4.prepare(wq)
    assert tuple(prepared.weight.shape) == (round_up(n, 32), round_up(k, 32) // 2)
    assert (prepared.channel_scale is None) == (parts is None)
    x = (torch.randn(2, 5, k, generator=gen) * 3).to(dtype).to(DEVICE)
    x[0, 0] *= 1000  # a loud row: the others keep their own tensor scales
    y = w4a4.w4a4_linear(x, prepared)
    assert y.shape == (2, 5, n) and y.dtype == dtype and len(fake_kernel) == 1
    check_close(y, emulated_linear(x, wq), dtype)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    check_close(w4a4.w4a4_linear(x, prepared, bias), emulated_linear(x, wq, bias), dtype, bias)
    # a row's output does not depend on its batch
    torch.testing.assert_close(w4a4.w4a4_linear(x[1, 2:3], prepared), y[1, 2:3], rtol=0, atol=0)


def test_the_adapter_refuses_fp32_and_passes_an_empty_batch(fake_kernel):
    wq = quantize_weight(torch.randn(32, 32).to(DEVICE))
    prepared = w4a4.prepare(wq)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        w4a4.w4a4_linear(torch.randn(2, 32).to(DEVICE), prepared)
    assert w4a4.w4a4_linear(torch.zeros(0, 32, dtype=torch.bfloat16).to(DEVICE), prepared).shape == (0, 32)
    assert not fake_kernel


def test_available_needs_sm100_and_vllms_fp4_gemm(monkeypatch):
    from vllm import _custom_ops as ops

    assert not w4a4.available(None) and not w4a4.available(90)
    if not hasattr(torch.ops._C, "cutlass_scaled_mm_supports_fp4"):  # a vLLM without its CUDA kernels (this CPU)
        assert not w4a4.available(100)
    asked = []
    monkeypatch.setattr(ops, "cutlass_scaled_mm_supports_fp4", lambda c: asked.append(c) or c in (100, 120))
    assert w4a4.available(100) and w4a4.available(120) and not w4a4.available(103) and not w4a4.available(90)
    assert asked == [100, 120, 103]  # below sm100 the build is not asked

    def missing(c):
        raise AttributeError("'_OpNamespace' '_C' object has no attribute 'cutlass_scaled_mm_supports_fp4'")

    monkeypatch.setattr(ops, "cutlass_scaled_mm_supports_fp4", missing)
    assert not w4a4.available(100)


@pytest.fixture
def on_blackwell(monkeypatch, fake_kernel):
    monkeypatch.setattr(paths, "gpu", lambda: (100, True, True))
    monkeypatch.delenv(paths.PATH_ENV, raising=False)
    return fake_kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_method_on_the_w4a4_path_is_the_emulation(on_blackwell, one_rank, dtype):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    config = Quartet2Config()
    assert config.path == "w4a4"
    quant = config.get_quant_method(object.__new__(ReplicatedLinear), "model.layers.0.self_attn.qkv_proj")
    gen = torch.Generator().manual_seed(11)
    w = (torch.randn(48, 96, generator=gen) * 0.05).to(dtype).to(DEVICE)
    layer = on_the_fly_layer(quant, w, [32, 16], dtype)
    assert not hasattr(layer, "weight") and not hasattr(layer, "weight_packed")
    assert tuple(layer.w4a4_weight.shape) == (64, 48) and tuple(layer.w4a4_weight_scale.shape) == (128, 8)
    assert layer.w4a4_channel_scale.shape == (48,)  # q / k parts: a tensor scale each
    x = torch.randn(7, 96, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(48, generator=gen).to(dtype).to(DEVICE)
    y = quant.apply(layer, x, bias)
    check_close(y, emulated_linear(x, quantize_parts(w, [32, 16]), bias), dtype, bias)
    assert len(on_blackwell) == 1


def test_the_w4a4_path_reads_fused_nvfp4_checkpoints(on_blackwell, one_rank):
    """A CloverLM fused layer, two parts of their own tensor scales: each part's emulation, side by side."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    from tests.quant.quartet2.plugin.test_method import CLOVERLM_NVFP4

    config = Quartet2Config.from_config(CLOVERLM_NVFP4)
    assert config.path == "w4a4"
    quant = config.get_quant_method(object.__new__(ReplicatedLinear), "transformer.blocks.0.mhsa.lqkv")
    gen = torch.Generator().manual_seed(12)
    stored = [quantize_weight((torch.randn(128, 128, generator=gen) * s).to(DEVICE)) for s in (0.02, 0.5)]
    layer = nvfp4_fused_layer(quant, stored)
    x = torch.randn(3, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    want = torch.cat([emulated_linear(x, q) for q in stored], dim=-1)
    check_close(quant.apply(layer, x), want, torch.bfloat16)
