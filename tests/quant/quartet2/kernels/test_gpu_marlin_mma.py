"""GPU: the native few-token GEMM (quant.quartet2.kernels.marlin_mma, built with
`python -m turboquant_vllm.quant.quartet2.kernels.marlin_mma build`) over Marlin's real layout (vLLM's repack on the
GPU): against its PyTorch emulation (naive.py: the same decode, the same sums in the same order; the tensor core's
rounding inside one mma may differ: a last-bit difference in a few outputs) and against the W4A16 reference (one
rounding of fp32 sums, as test_gpu_marlin.py bounds it); poisoned outputs, every token count 1-8, both activation
dtypes, padded shapes, repeat calls and CUDA-graph replays bit-identical, the K splits added in a cluster (sm_90) or
through global memory giving the same bits.

    pytest -m gpu tests/quant/quartet2/kernels/test_gpu_marlin_mma.py
"""

from __future__ import annotations

import pytest
import torch

from tests.quant.quartet2.kernels.test_gpu_marlin import assert_w4a16, quantized, random_weight
from turboquant_vllm.quant.quartet2 import nvfp4
from turboquant_vllm.quant.quartet2.kernels import marlin, marlin_mma
from turboquant_vllm.quant.quartet2.kernels.dequantize.naive import unscaled_values
from turboquant_vllm.quant.quartet2.kernels.marlin_mma.naive import emulate
from turboquant_vllm.quant.quartet2.kernels.quantize import quantize_weight

pytestmark = pytest.mark.gpu

SHAPES = [(5376, 3584), (3584, 14336), (1000, 1040), (136, 496)]  # (N, K): CloverLM's qkv and down; padded; tiny


@pytest.fixture(scope="module", autouse=True)
def built():
    if torch.cuda.is_available() and marlin_mma.supported(torch.device("cuda")) is not None:
        pytest.skip(f"the few-token kernel: {marlin_mma.supported(torch.device('cuda'))}")


def prepared(n, k, dtype):
    m = marlin.prepare(quantized(n, k), dtype)
    assert m.mma_max_tokens == marlin_mma.POLICY_TOKENS
    return m


def call(x, m, out=None):
    return marlin_mma.gemm(x, m.weight, m.weight_scale, m.size_n, m.size_k, m.dense_alpha, out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_the_kernel_is_its_emulation_and_w4a16(dtype, shape):
    n, k = shape
    m = prepared(n, k, dtype)
    props = torch.cuda.get_device_properties(0)
    splits, per = marlin_mma.split_plan(m.weight_scale.shape[1], k, props.multi_processor_count)
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    for tokens in (1, 2, 5, 8):
        x = (torch.randn(tokens, k, generator=gen, device="cuda") * 0.5).to(dtype)
        out = torch.full((tokens, n), float("nan"), dtype=dtype, device="cuda")
        y = call(x, m, out)
        assert y.data_ptr() == out.data_ptr() and not y.isnan().any()
        want = emulate(x, m.weight, m.weight_scale, n, k, m.dense_alpha, splits, per)
        w = quantized(n, k)
        magnitude = (x.double().abs() @ unscaled_values(w.packed, w.scales).double().abs().t()
                     * w.tensor_scale.double())
        # one ulp of the output, or where the sum cancels, the tensor core's fp32 rounding of its terms
        bound = torch.finfo(dtype).eps * want.double().abs() + 2**-20 * magnitude
        diff = (y.double() - want.double()).abs()
        assert (diff <= bound).all(), f"{tokens} tokens: {int((diff > bound).sum())} outputs past the bound"
        assert (diff == 0).float().mean() >= 0.99, f"{tokens} tokens: {float((diff == 0).float().mean()):.4f} equal"
        assert_w4a16(y, x, quantized(n, k))


def test_the_op_takes_it_up_to_the_policys_tokens_and_marlin_beyond():
    n, k = 5376, 3584
    m = prepared(n, k, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for tokens in (1, marlin_mma.POLICY_TOKENS, marlin_mma.POLICY_TOKENS + 1):
        x = torch.randn(tokens, k, generator=gen, device="cuda").to(torch.bfloat16)
        y = marlin.marlin_linear(x, m)
        marlin_only = marlin.marlin_linear(x, m._replace(mma_max_tokens=0))
        if tokens <= marlin_mma.POLICY_TOKENS:
            assert torch.equal(y, call(x, m))
        else:
            assert torch.equal(y, marlin_only)
        assert_w4a16(y, x, quantized(n, k))


def splits_of(m) -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return marlin_mma.split_plan(m.weight_scale.shape[1], m.size_k, sms)[0]


@pytest.mark.parametrize("shape", [(5376, 3584), (3584, 14336), (1000, 1040), (136, 496)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_cluster_sum_is_the_global_sum(shape):
    n, k = shape
    if torch.cuda.get_device_capability(0) < (9, 0):
        pytest.skip("thread-block clusters need sm_90")
    m = prepared(n, k, torch.bfloat16)
    assert 1 < splits_of(m) <= marlin_mma.MAX_CLUSTER and marlin_mma.clusters(torch.device("cuda"), splits_of(m))
    gen = torch.Generator(device="cuda").manual_seed(n)
    for dtype in (torch.bfloat16, torch.float16):
        md = prepared(n, k, dtype)
        for tokens in (1, 3, 8):
            x = torch.randn(tokens, k, generator=gen, device="cuda").to(dtype)
            a, b = (marlin_mma.gemm(x, md.weight, md.weight_scale, n, k, md.dense_alpha,
                                    torch.full((tokens, n), float("nan"), dtype=dtype, device="cuda"), cluster=c)
                    for c in (True, False))
            assert torch.equal(a, b) and not a.isnan().any()


def test_more_splits_than_a_cluster_holds_go_through_global_memory():
    m = prepared(64, 4096, torch.bfloat16)  # one n-tile: the plan wants as many splits as the k-tiles allow
    assert splits_of(m) > marlin_mma.MAX_CLUSTER and not marlin_mma.clusters(torch.device("cuda"), splits_of(m))
    x = torch.randn(2, 4096, device="cuda").to(torch.bfloat16)
    assert_w4a16(call(x, m), x, quantized(64, 4096))
    with pytest.raises(ValueError, match="cluster"):
        marlin_mma.gemm(x, m.weight, m.weight_scale, m.size_n, m.size_k, m.dense_alpha, cluster=True)


@pytest.mark.parametrize("cluster", [True, False], ids=["cluster-sum", "global-sum"])
def test_repeats_and_graph_replays_are_bit_identical(cluster):
    n, k = 3584, 14336  # 8 K splits on an H100
    if cluster and torch.cuda.get_device_capability(0) < (9, 0):
        pytest.skip("thread-block clusters need sm_90")
    m = prepared(n, k, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(4, k, generator=gen, device="cuda").to(torch.bfloat16)

    def call(x, m):
        return marlin_mma.gemm(x, m.weight, m.weight_scale, m.size_n, m.size_k, m.dense_alpha, cluster=cluster)

    first = call(x, m)
    assert all(torch.equal(call(x, m), first) for _ in range(20))
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(static_x, m)  # warm
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = call(static_x, m)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, first)
    other = torch.randn(4, k, generator=gen, device="cuda").to(torch.bfloat16)
    static_x.copy_(other)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, call(other, m))


def test_bad_calls_are_refused():
    m = prepared(136, 496, torch.bfloat16)
    with pytest.raises(ValueError, match="1-8 tokens"):
        call(torch.zeros(9, 496, dtype=torch.bfloat16, device="cuda"), m)
    with pytest.raises(ValueError, match="1-8 tokens"):
        call(torch.zeros(2, 496, dtype=torch.float32, device="cuda"), m)
    with pytest.raises(ValueError, match="contiguous"):
        call(torch.zeros(2, 496, dtype=torch.bfloat16, device="cuda"), m,
             torch.empty(2, 200, dtype=torch.bfloat16, device="cuda"))


def test_the_fused_layer_keeps_its_per_part_scales():
    """qkv read from a checkpoint: parts with their own tensor scales, the per-column ratio after the kernel."""
    parts = [quantize_weight(random_weight(n, 512, 50 + i, s)) for i, (n, s) in enumerate([(256, 0.02),
                                                                                                   (128, 0.3)])]
    w = nvfp4.NVFP4Weight(torch.cat([q.packed for q in parts]), torch.cat([q.scales for q in parts]),
                           torch.cat([q.tensor_scale.expand(q.packed.shape[0]) for q in parts]))
    m = marlin.prepare(w, torch.bfloat16)
    x = torch.randn(3, 512, device="cuda").to(torch.bfloat16)
    assert_w4a16(marlin.marlin_linear(x, m), x, w, roundings=2)
