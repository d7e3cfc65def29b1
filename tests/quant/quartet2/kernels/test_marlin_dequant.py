"""The marlin path's large-batch GEMM (quant.quartet2.kernels.marlin_dequant) on the CPU, over Marlin's layout as
vLLM makes it (conftest.py): the PyTorch (naive.py) and Triton (interpreter) decoders against our exact NVFP4 values,
and the dense GEMM against the W4A16 reference. On the GPU, with the real repack: test_gpu_marlin.py."""

import pytest
import torch

from tests.conftest import DEVICE
from turboquant_vllm.quant.quartet2 import nvfp4
from turboquant_vllm.quant.quartet2.kernels import marlin, marlin_dequant, marlin_layout
from turboquant_vllm.quant.quartet2.kernels.dequantize.naive import unscaled_values
from turboquant_vllm.quant.quartet2.kernels.marlin.naive import w4a16_reference
from turboquant_vllm.quant.quartet2.kernels.marlin_dequant.naive import dequantize_reference
from turboquant_vllm.quant.quartet2.kernels.quantize import quantize_weight


def weight(n, k, seed, case="quantized"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=gen) * 0.05
    if case == "tiny groups":  # E4M3-subnormal block scales: flushed by Marlin
        x[:, :32] *= 1e-4
    w = quantize_weight(x.to(DEVICE))
    if case == "small scales":  # every block scale far below 448: vLLM lifts a bf16 layer's by a power of two
        w = w._replace(scales=(w.scales.float() / 64).to(torch.float8_e4m3fn), tensor_scale=w.tensor_scale * 64)
    return w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["quantized", "small scales", "tiny groups"])
@pytest.mark.parametrize("shape", [(192, 256), (100, 208)], ids=["192x256", "100x208-padded"])
def test_both_decoders_read_marlins_layout_exactly(marlin_layout_on_cpu, dtype, case, shape):
    n, k = shape
    w = weight(n, k, n + k, case)
    m = marlin.prepare(w, dtype)
    t = marlin_layout.tables(m.weight.device, dtype)
    lift = float(w.tensor_scale) / m.dense_alpha
    assert lift >= 1 and (lift > 1) == (case == "small scales" and dtype == torch.bfloat16)
    want = unscaled_values(w.packed, w.scales) * lift
    flushed = marlin.marlin_flushed_groups(w.scales, dtype)
    assert flushed.any() == (case == "tiny groups")
    want[flushed.repeat_interleave(nvfp4.GROUP, dim=1)] = 0
    assert torch.equal(dequantize_reference(m.weight, m.weight_scale, t, n, k), want)
    out = torch.full((n * k + 7,), float("nan"), dtype=dtype, device=DEVICE)  # poisoned, and longer than the weight
    got = marlin_dequant.dequantize(m.weight, m.weight_scale, n, k, out)
    assert got.shape == (n, k) and torch.equal(got.float(), want)
    assert out[n * k:].isnan().all()  # nothing written past the weight


@pytest.mark.parametrize("fused", [False, True], ids=["one-scale", "per-part"])
def test_the_dense_gemm_is_w4a16(marlin_layout_on_cpu, fused):
    if fused:  # parts with their own tensor scales: a per-column ratio after the GEMM
        parts = [weight(64, 160, 1), weight(128, 160, 2, "small scales")]
        w = nvfp4.NVFP4Weight(torch.cat([p.packed for p in parts]), torch.cat([p.scales for p in parts]),
                               torch.cat([p.tensor_scale.expand(p.packed.shape[0]) for p in parts]))
    else:
        w = weight(192, 160, 3)
    m = marlin.prepare(w, torch.bfloat16)._replace(dense_min_tokens=1)  # every call decodes (on the GPU: 512 on)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 9, 160, generator=gen).to(torch.bfloat16).to(DEVICE)
    y = marlin.marlin_linear(x, m)
    assert y.shape == (2, 9, m.size_n) and y.dtype == torch.bfloat16 and not y.isnan().any()
    u = 2**-8  # one rounding (two with the per-column ratio); fp32 sums far below it
    ref = w4a16_reference(x.reshape(18, 160), w).reshape(2, 9, -1)
    magnitude = (x.double().abs().reshape(18, 160) @ unscaled_values(w.packed, w.scales).double().abs().t()
                 * w.tensor_scale.double()).reshape(2, 9, -1)
    assert ((y.double() - ref).abs() <= (2 if fused else 1) * u * ref.abs() + 2**-16 * magnitude).all()


def test_the_threshold_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(marlin.DENSE_ENV, raising=False)
    assert marlin.dense_threshold() == marlin_dequant.DENSE_MIN_TOKENS
    monkeypatch.setenv(marlin.DENSE_ENV, "0")
    assert marlin.dense_threshold() == 0
    monkeypatch.setenv(marlin.DENSE_ENV, "lots")
    with pytest.raises(ValueError, match="token count"):
        marlin.dense_threshold()


def test_prepare_leaves_the_nvfp4_weight_as_it_is(marlin_layout_on_cpu):
    """vLLM writes a repacked tensor into the parameter it replaces where shape and dtype agree: 128 x 2048 has
    scales of Marlin's scales' shape, and the global scale always agrees. The caller's weight stays as it was."""
    w = weight(128, 2048, 5, "small scales")
    before = [t.clone() for t in w]
    m = marlin.prepare(w, torch.bfloat16)
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b) for a, b in zip(w, before))
    assert m.weight_scale.shape == w.scales.shape and m.dense_alpha == float(w.tensor_scale) / 2 ** 6
