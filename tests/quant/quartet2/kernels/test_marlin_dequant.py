"""The marlin path's large-batch GEMM (quant.quartet2.marlin_dequant) on the CPU: Marlin's layout made by vLLM's own
prepare_fp4_layer_for_marlin, its one CUDA op (gptq_marlin_repack) replaced by vLLM's plain-PyTorch reference of it;
the probed tables (the layout the decoder is written for), the PyTorch and Triton (interpreter) decoders against our
exact NVFP4 values, and the dense GEMM
against the W4A16 reference. On the GPU, with the real repack: test_gpu_marlin.py."""

import pytest
import torch

from tests.conftest import DEVICE
from turboquant_vllm.quant.quartet2 import linear, marlin, marlin_dequant, nvfp4


def reference_repack(b_q_weight, perm, size_k, size_n, num_bits, is_a_8bit=False):
    """gptq_marlin_repack by vLLM's Python reference (marlin_utils_test.marlin_weights)."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import get_weight_perm, marlin_weights

    assert num_bits == 4 and not is_a_8bit and perm.numel() == 0
    codes = marlin_dequant.unpack_words(b_q_weight.cpu()).permute(0, 2, 1).reshape(size_k, size_n)
    return marlin_weights(codes.to(torch.int32), size_k, size_n, 4, get_weight_perm(4)).to(b_q_weight.device)


@pytest.fixture
def marlin_layout_on_cpu(monkeypatch):
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils import marlin_utils_fp4

    monkeypatch.setattr(ops, "gptq_marlin_repack", reference_repack, raising=False)
    monkeypatch.setattr(marlin_utils_fp4, "marlin_make_workspace_new",
                        lambda device, *a, **kw: torch.zeros(1, dtype=torch.int32, device=device))
    marlin_dequant.tables.cache_clear()
    yield
    marlin_dequant.tables.cache_clear()


def weight(n, k, seed, case="quantized"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=gen) * 0.05
    if case == "tiny groups":  # E4M3-subnormal block scales: flushed by Marlin
        x[:, :32] *= 1e-4
    w = linear.quantize_weight(x.to(DEVICE))
    if case == "small scales":  # every block scale far below 448: vLLM lifts a bf16 layer's by a power of two
        w = w._replace(scales=(w.scales.float() / 64).to(torch.float8_e4m3fn), tensor_scale=w.tensor_scale * 64)
    return w


def test_the_probed_tables_are_one_permutation_of_the_tile(marlin_layout_on_cpu):
    t = marlin_dequant.tables(torch.device(DEVICE), torch.bfloat16)
    assert t.word.shape == t.shift.shape == (16, 64) and t.scale_column.shape == (64,)
    place = (t.word * 8 + t.shift // 4).reshape(-1)
    assert torch.equal(place.sort().values.cpu(), torch.arange(1024))
    assert torch.equal(t.scale_column.sort().values.cpu(), torch.arange(64, dtype=torch.int32))
    assert not torch.equal(t.scale_column.cpu(), torch.arange(64, dtype=torch.int32))  # a permutation, not none


def test_the_decoder_is_written_for_the_layout_vllm_makes(marlin_layout_on_cpu):
    t = marlin_dequant.tables(torch.device(DEVICE), torch.bfloat16)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(t, marlin_dequant.tile_layout()))


def test_another_tiled_layout_is_refused_with_the_way_out(marlin_layout_on_cpu, monkeypatch):
    word, shift = marlin_dequant.tile_layout()[:2]
    monkeypatch.setattr(marlin_dequant, "weight_tables", lambda repack: (word.flip(1), shift))
    with pytest.raises(RuntimeError, match="TURBOQUANT_QUARTET2_DENSE_MIN_TOKENS=0"):
        marlin_dequant.tables(torch.device(DEVICE), torch.bfloat16)


def test_a_layout_that_is_not_tiled_is_refused():
    with pytest.raises(RuntimeError, match="not one permutation per 16 x 64 tile"):
        marlin_dequant.weight_tables(lambda q, k, n: torch.arange(k // 8 * n, dtype=torch.int32).reshape(-1, 2 * n))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["quantized", "small scales", "tiny groups"])
@pytest.mark.parametrize("shape", [(192, 256), (100, 208)], ids=["192x256", "100x208-padded"])
def test_both_decoders_read_marlins_layout_exactly(marlin_layout_on_cpu, dtype, case, shape):
    n, k = shape
    w = weight(n, k, n + k, case)
    m = marlin.prepare(w, dtype)
    t = marlin_dequant.tables(m.weight.device, dtype)
    lift = float(w.tensor_scale) / m.dense_alpha
    assert lift >= 1 and (lift > 1) == (case == "small scales" and dtype == torch.bfloat16)
    want = linear.unscaled_values(w.packed, w.scales) * lift
    flushed = marlin.marlin_flushed_groups(w.scales, dtype)
    assert flushed.any() == (case == "tiny groups")
    want[flushed.repeat_interleave(nvfp4.GROUP, dim=1)] = 0
    assert torch.equal(marlin_dequant.dequantize_reference(m.weight, m.weight_scale, t, n, k), want)
    out = torch.full((n * k + 7,), float("nan"), dtype=dtype, device=DEVICE)  # poisoned, and longer than the weight
    got = marlin_dequant.dequantize(m.weight, m.weight_scale, n, k, out)
    assert got.shape == (n, k) and torch.equal(got.float(), want)
    assert out[n * k:].isnan().all()  # nothing written past the weight


@pytest.mark.parametrize("fused", [False, True], ids=["one-scale", "per-part"])
def test_the_dense_gemm_is_w4a16(marlin_layout_on_cpu, fused):
    from tests.quant.quartet2.test_marlin import w4a16

    if fused:  # parts with their own tensor scales: a per-column ratio after the GEMM
        parts = [weight(64, 160, 1), weight(128, 160, 2, "small scales")]
        w = linear.NVFP4Weight(torch.cat([p.packed for p in parts]), torch.cat([p.scales for p in parts]),
                               torch.cat([p.tensor_scale.expand(p.packed.shape[0]) for p in parts]))
    else:
        w = weight(192, 160, 3)
    m = marlin.prepare(w, torch.bfloat16)._replace(dense_min_tokens=1)  # every call decodes (on the GPU: 512 on)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 9, 160, generator=gen).to(torch.bfloat16).to(DEVICE)
    y = marlin.marlin_linear(x, m)
    assert y.shape == (2, 9, m.size_n) and y.dtype == torch.bfloat16 and not y.isnan().any()
    u = 2**-8  # one rounding (two with the per-column ratio); fp32 sums far below it
    ref = w4a16(x.reshape(18, 160), w).reshape(2, 9, -1)
    magnitude = (x.double().abs().reshape(18, 160) @ linear.unscaled_values(w.packed, w.scales).double().abs().t()
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
