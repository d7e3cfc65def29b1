"""GPU: quartet2's marlin path (NVFP4 weights through vLLM's Marlin FP4 kernel, W4A16) against the W4A16 reference:
activations unquantized, the weight the exact NVFP4 values (code x E4M3 scale x tensor scale), summed in float64.

Expected error: Marlin multiplies code x scale in the activations' dtype (exact: at most 7 significant bits), each
product with an activation is exact in fp32, the sums are fp32 (fp32 reduce across its k-splits), the tensor scale
multiplies them in fp32 and the result is rounded once to bf16 / fp16. So |y - ref| <= u |ref| (u = 2^-8 for bf16,
2^-11 for fp16) plus the fp32 sums' error, bounded here by 2^-16 sum_k |x_k w_k| (far above its typical size,
~2^-24 sqrt(K), and far below u |ref| for outputs not cancelled to near zero). A fused layer with per-part tensor
scales rounds a second time (the per-column ratio after the kernel): 2u. A bias added after the kernel: one more, of
the sum.

    pytest -m gpu tests/quant/quartet2/kernels/test_gpu_marlin.py
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.quant.quartet2.plugin.layers import on_the_fly_layer
from turboquant_vllm.quant.quartet2 import nvfp4
from turboquant_vllm.quant.quartet2.kernels import marlin, marlin_dequant, marlin_layout
from turboquant_vllm.quant.quartet2.kernels.dequantize.naive import unscaled_values
from turboquant_vllm.quant.quartet2.kernels.marlin_dequant.naive import dequantize_reference
from turboquant_vllm.quant.quartet2.kernels.quantize import quantize_weight
from turboquant_vllm.quant.quartet2.plugin import paths
from turboquant_vllm.quant.quartet2.plugin.config import Quartet2Config

pytestmark = pytest.mark.gpu

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (1000, 1040)]  # (N, K); the last: padded to Marlin's tiles
MS = [1, 7, 64, 300, 700]  # 700: past marlin_dequant.DENSE_MIN_TOKENS, the weight decoded for one cuBLAS call
DTYPES = [torch.bfloat16, torch.float16]


def random_weight(n, k, seed, scale=0.02):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(n, k, generator=gen, device="cuda") * scale).to(torch.bfloat16)


@functools.cache
def quantized(n, k):
    return quantize_weight(random_weight(n, k, n * 7 + k))


@functools.cache
def prepared(n, k, dtype):
    return marlin.prepare(quantized(n, k), dtype)


def fused_weight(parts=((4096, 0.02), (1024, 0.05), (1024, 0.3)), k=4096):
    """qkv-like: parts quantized with their own tensor scales (a CloverLM checkpoint's fused layer), one per row."""
    qs = [quantize_weight(random_weight(n, k, 100 + i, s)) for i, (n, s) in enumerate(parts)]
    return nvfp4.NVFP4Weight(torch.cat([q.packed for q in qs]), torch.cat([q.scales for q in qs]),
                              torch.cat([q.tensor_scale.expand(q.packed.shape[0]) for q in qs]))


def assert_w4a16(y, x, w, roundings=1, bias=None):
    """y within `roundings` roundings of x W^T (relative to it) and, with a bias, one more of x W^T + bias."""
    u = torch.finfo(y.dtype).eps / 2
    values = unscaled_values(w.packed, w.scales).double()
    ts = w.tensor_scale.double()
    product = (x.double() @ values.t()) * ts
    magnitude = (x.double().abs() @ values.abs().t()) * ts
    bound = roundings * u * product.abs() + 2**-16 * magnitude + torch.finfo(y.dtype).smallest_normal * u
    ref = product
    if bias is not None:
        ref = product + bias.double()
        bound = bound + u * ref.abs()
    err = (y.double() - ref).abs()
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert (err <= bound).all(), f"error / bound up to {(err / bound).max().item():.3g}"
    # and the typical error is that of the roundings (one rounding's relative RMS is at most u / sqrt(3))
    typical = 0.75 * u * (roundings * product.norm() + (ref.norm() if bias is not None else 0))
    assert err.norm() < typical, f"RMS error {err.norm() / typical:.3g} of the expected"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_marlin_is_w4a16(shape, dtype):
    n, k = shape
    w, m = quantized(n, k), prepared(n, k, dtype)
    assert m.channel_scale is None and (m.size_n, m.size_k) == (n, k)
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    for rows in MS:
        x = torch.randn(rows, k, generator=gen, device="cuda").to(dtype)
        assert_w4a16(marlin.marlin_linear(x, m), x, w)
    x = torch.randn(2, 3, k, generator=gen, device="cuda").to(dtype)  # leading dimensions, and a bias
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype)
    y = marlin.marlin_linear(x, m, bias)
    assert y.shape == (2, 3, n)
    assert_w4a16(y.reshape(6, n), x.reshape(6, k), w, bias=bias)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_decoder_reads_the_real_repack_exactly(shape, dtype):
    """gptq_marlin_repack's layout, read back by the probed tables (Triton and PyTorch): code x scale x vLLM's lift,
    bit for bit; scratch past the weight untouched."""
    n, k = shape
    w, m = quantized(n, k), prepared(n, k, dtype)
    t = marlin_layout.tables(m.weight.device, dtype)
    want = unscaled_values(w.packed, w.scales) * (float(w.tensor_scale) / m.dense_alpha)
    want[marlin.marlin_flushed_groups(w.scales, dtype).repeat_interleave(nvfp4.GROUP, dim=1)] = 0
    out = torch.full((n * k + 7,), float("nan"), dtype=dtype, device="cuda")
    assert torch.equal(marlin_dequant.dequantize(m.weight, m.weight_scale, n, k, out).float(), want)
    assert out[n * k:].isnan().all()
    assert torch.equal(dequantize_reference(m.weight, m.weight_scale, t, n, k), want)


def test_small_scales_lifted_by_vllm_decode_exactly():
    """A bf16 layer whose block scales vLLM lifts by a power of two (all far below 448): alpha undoes the lift."""
    w = quantized(1024, 2048)
    w = w._replace(scales=(w.scales.float() / 64).to(torch.float8_e4m3fn), tensor_scale=w.tensor_scale * 64)
    m = marlin.prepare(w, torch.bfloat16)
    assert float(w.tensor_scale) / m.dense_alpha > 1
    x = torch.randn(600, 2048, generator=torch.Generator(device="cuda").manual_seed(2), device="cuda")
    x = x.to(torch.bfloat16)
    assert_w4a16(marlin.marlin_linear(x, m), x, w)
    assert_w4a16(marlin.marlin_linear(x[:5], m), x[:5], w)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_fused_parts_with_their_own_tensor_scales(dtype):
    w = fused_weight()
    m = marlin.prepare(w, dtype)
    assert m.channel_scale is not None and m.channel_scale.shape == (6144,)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for rows in MS:
        x = torch.randn(rows, 4096, generator=gen, device="cuda").to(dtype)
        assert_w4a16(marlin.marlin_linear(x, m), x, w, roundings=2)
    bias = torch.randn(6144, generator=gen, device="cuda").to(dtype)
    assert_w4a16(marlin.marlin_linear(x, m, bias), x, w, bias=bias)  # Marlin's rounding, then the sum's


def test_groups_below_marlins_scale_range_run_as_zeros():
    """Every group but one far below the weight's largest value (E4M3-subnormal block scales), the one multiplied
    by zero activations: the whole output is what the flushed groups give, zero, as marlin_flushed_groups says."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    weight = (torch.randn(256, 512, generator=gen, device="cuda") * 5e-6).to(torch.bfloat16)
    weight[0, 0] = 1.0
    w = quantize_weight(weight)
    flushed = marlin.marlin_flushed_groups(w.scales, torch.bfloat16)
    expected = w.scales.float() > 0
    expected[0, 0] = False
    assert torch.equal(flushed, expected) and flushed.float().mean() > 0.9
    x = torch.randn(600, 512, generator=gen, device="cuda").to(torch.bfloat16)
    x[:, :16] = 0
    assert unscaled_values(w.packed, w.scales)[:, 16:].abs().sum() > 0  # the exact weight is not zero there
    m = marlin.prepare(w, torch.bfloat16)
    assert (marlin.marlin_linear(x[:5], m) == 0).all() and (marlin.marlin_linear(x, m) == 0).all()  # both GEMMs


@pytest.mark.parametrize("rows", [7, 600], ids=["marlin", "decoded"])
@pytest.mark.parametrize("fused", [False, True], ids=["one-scale", "per-part"])
def test_cuda_graph_replays_the_eager_output(fused, rows):
    w = fused_weight() if fused else quantized(4096, 4096)
    m = marlin.prepare(w, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(rows, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    bias = torch.randn(m.size_n, generator=gen, device="cuda").to(torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            marlin.marlin_linear(x, m, bias)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = marlin.marlin_linear(x, m, bias)
    for seed in (6, 7):
        x.copy_(torch.randn(rows, 4096, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, marlin.marlin_linear(x, m, bias))


def test_the_method_serves_a_layer_through_marlin(monkeypatch, one_rank):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    monkeypatch.delenv(paths.PATH_ENV, raising=False)
    config = Quartet2Config()
    assert config.path == "marlin"
    quant = config.get_quant_method(object.__new__(ReplicatedLinear), "model.layers.0.mlp.down_proj")
    weight = random_weight(1024, 2048, 9)
    layer = on_the_fly_layer(quant, weight, [1024], torch.bfloat16)
    x = torch.randn(3, 2048, device="cuda").to(torch.bfloat16)
    assert_w4a16(quant.apply(layer, x), x, quantize_weight(weight))


def test_torch_compile_chooses_the_gemm_per_call():
    """One graph compiled for dynamic token counts: each call still takes its own GEMM (a custom op, not a traced
    branch), the eager output bit for bit on either side of the threshold."""
    m = prepared(4096, 4096, torch.bfloat16)
    compiled = torch.compile(lambda x: marlin.marlin_linear(x, m), dynamic=True, fullgraph=True)
    gen = torch.Generator(device="cuda").manual_seed(12)
    for rows in (3, 700, 9, 1500):
        x = torch.randn(rows, 4096, generator=gen, device="cuda").to(torch.bfloat16)
        assert torch.equal(compiled(x), marlin.marlin_linear(x, m))
    decoded = m._replace(dense_min_tokens=1)
    x = torch.randn(700, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    assert not torch.equal(marlin.marlin_linear(x, decoded), marlin.marlin_linear(x, m._replace(dense_min_tokens=0)))
