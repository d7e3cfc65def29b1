"""quartet2's Marlin path (quant.quartet2.kernels.marlin) on the CPU: our NVFP4 weights in vLLM's pre-Marlin layout
decode, by vLLM's own NVFP4 dequantization, to exactly our values; the scale bytes vLLM makes for the kernel hold
exactly our scales except the ones marlin_flushed_groups predicts; and the method's marlin path wired through vLLM's
Marlin helpers (the two CUDA-only entry points replaced by a plain-PyTorch W4A16 stand-in) gives the W4A16 reference
(naive.py). The kernel itself: test_gpu_marlin.py."""

import pytest
import torch

from tests.conftest import DEVICE
from tests.quant.quartet2.plugin.layers import nvfp4_fused_layer, on_the_fly_layer
from turboquant_vllm.quant.quartet2 import nvfp4
from turboquant_vllm.quant.quartet2.kernels import marlin
from turboquant_vllm.quant.quartet2.kernels.dequantize.naive import unscaled_values
from turboquant_vllm.quant.quartet2.kernels.marlin.naive import w4a16_reference
from turboquant_vllm.quant.quartet2.kernels.quantize import quantize_weight
from turboquant_vllm.quant.quartet2.plugin import paths
from turboquant_vllm.quant.quartet2.plugin.config import Quartet2Config


def quantized(n, k, seed, scale=0.05):
    gen = torch.Generator().manual_seed(seed)
    return quantize_weight((torch.randn(n, k, generator=gen) * scale).to(DEVICE))


def vllm_dequantize(weight, weight_scale, global_scale):
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

    return dequantize_to_dtype(weight, weight_scale, global_scale, torch.float32, swizzle=False)


def test_one_tensor_scale_is_vllms_global_scale_and_the_codes_decode_exactly():
    w = quantized(48, 160, 0)
    v = marlin.to_vllm_nvfp4(w)
    assert v.channel_scale is None and v.weight.dtype == torch.uint8 and v.weight_scale.dtype == torch.float8_e4m3fn
    assert torch.equal(v.weight, w.packed) and torch.equal(v.weight_scale.view(torch.uint8), w.scales.view(torch.uint8))
    assert v.weight_global_scale.shape == () and torch.equal(v.weight_global_scale, w.tensor_scale)
    one = torch.ones((), device=v.weight.device)
    # vLLM's nibble order, sign bit and E2M1 table: code x group scale, bit for bit
    assert torch.equal(vllm_dequantize(v.weight, v.weight_scale, one), unscaled_values(w.packed, w.scales))
    # with the global scale: one rounding of the same product, multiplied in another order
    torch.testing.assert_close(vllm_dequantize(v.weight, v.weight_scale, v.weight_global_scale),
                               unscaled_values(w.packed, w.scales) * w.tensor_scale, rtol=2.5e-7, atol=0)


def test_fused_parts_keep_their_tensor_scales_exactly():
    """Parts with their own tensor scales: a power-of-two global scale and per-column ratios whose product is each
    row's tensor scale, bit for bit; codes and block scales untouched."""
    parts = [quantized(128, 64, 1, 0.02), quantized(64, 64, 2, 0.5), quantized(128, 64, 3, 0.07)]
    w = nvfp4.NVFP4Weight(torch.cat([p.packed for p in parts]), torch.cat([p.scales for p in parts]),
                           torch.cat([p.tensor_scale.expand(p.packed.shape[0]) for p in parts]))
    v = marlin.to_vllm_nvfp4(w)
    g = v.weight_global_scale
    mantissa, _ = torch.frexp(g)
    assert g.shape == () and mantissa.item() == 0.5 and g >= w.tensor_scale.max() and g < 2 * w.tensor_scale.max()
    assert torch.equal(v.channel_scale * g, w.tensor_scale)
    assert torch.equal(v.weight, w.packed) and torch.equal(v.weight_scale.view(torch.uint8), w.scales.view(torch.uint8))
    # equal tensor scales per row are one global scale
    same = nvfp4.NVFP4Weight(w.packed, w.scales, torch.full_like(w.tensor_scale, 0.125))
    assert marlin.to_vllm_nvfp4(same).channel_scale is None and marlin.to_vllm_nvfp4(same).weight_global_scale == 0.125


def decode_marlin_scale_bytes(processed, factor):
    """vLLM's S0E5M3 scale bytes (the top byte of fp16(scale * factor * 2^7) << 1) -> the scales, in the order they
    were given (vLLM swaps the middle two of every 4)."""
    half = (processed.view(torch.uint8).to(torch.int16) << 7).view(torch.float16).to(torch.float32)
    values = half / 2**7 / factor
    return values.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(processed.shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["quantized", "small", "subnormal"])
def test_marlin_scale_bytes_hold_our_scales_except_the_flushed(dtype, case):
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import nvfp4_marlin_process_scales

    gen = torch.Generator().manual_seed(7)
    if case == "quantized":  # the quantizer's own: largest ~256-384, a few tiny groups
        x = torch.randn(64, 256, generator=gen) * 0.05
        x[:, :16] *= 1e-5
        scales = quantize_weight(x.to(DEVICE)).scales.cpu()
    else:  # every E4M3 value from 2^-9 up to 2 (small: vLLM lifts them for bf16) or to 448, and zeros
        top = 0x40 if case == "small" else 0x7E
        codes = torch.randint(0, top + 1, (64, 16), generator=gen, dtype=torch.uint8)
        codes[0, :] = top
        scales = codes.view(torch.float8_e4m3fn)
    processed, factor = nvfp4_marlin_process_scales(scales.T.contiguous().to(dtype), a_dtype=dtype)
    seen = decode_marlin_scale_bytes(processed, factor).T
    flushed = marlin.marlin_flushed_groups(scales, dtype).cpu()
    s = scales.to(torch.float32)
    assert torch.equal(seen, torch.where(flushed, 0.0, s))
    if case == "subnormal":
        assert flushed.any()
    if case == "small":  # bf16: lifted by a power of two, nothing lost; fp16: no lift, the subnormals go
        assert (factor > 1) == (dtype == torch.bfloat16) and flushed.any() == (dtype == torch.float16)


def test_tensor_scales_must_fit_the_codes():
    w = quantized(16, 32, 4)
    with pytest.raises(ValueError, match="do not fit"):
        marlin.to_vllm_nvfp4(w._replace(tensor_scale=torch.ones(3, device=w.packed.device)))
    with pytest.raises(ValueError, match="finite and positive"):
        marlin.to_vllm_nvfp4(w._replace(tensor_scale=torch.zeros((), device=w.packed.device)))


@pytest.fixture
def marlin_on_cpu(monkeypatch):
    """The marlin path as on a Hopper GPU, vLLM's two CUDA-only Marlin entry points replaced: the layer's pre-Marlin
    tensors kept as they are, and a GEMM over their dequantized values (what the kernel computes, in float64)."""
    from vllm.model_executor.layers.quantization.utils import marlin_utils_fp4

    seen = {}

    def prepare(layer, input_dtype=None):
        seen.update(weight=layer.weight.data, weight_scale=layer.weight_scale.data,
                    global_scale=layer.weight_global_scale.data, dtype=layer.params_dtype,
                    n=layer.output_size_per_partition, k=layer.input_size_per_partition)

    def apply(input, weight, weight_scale, weight_global_scale, workspace, size_n, size_k, bias=None, **kw):
        assert workspace is None  # vLLM's own per-stream locks
        one = torch.ones((), device=weight.device)
        w = vllm_dequantize(weight, weight_scale, one).double() * weight_global_scale.double()
        assert bias is None and w.shape == (size_n, size_k)
        return (input.double() @ w.t()).to(input.dtype)

    monkeypatch.setattr(marlin_utils_fp4, "prepare_fp4_layer_for_marlin", prepare)
    monkeypatch.setattr(marlin_utils_fp4, "apply_fp4_marlin_linear", apply)
    monkeypatch.setattr(paths, "gpu", lambda: (90, True, False))
    monkeypatch.delenv(paths.PATH_ENV, raising=False)
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_marlin_path_on_the_fly_is_w4a16(marlin_on_cpu, one_rank, dtype):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    config = Quartet2Config()
    assert config.path == "marlin"
    quant = config.get_quant_method(object.__new__(ReplicatedLinear), "model.layers.0.mlp.down_proj")
    gen = torch.Generator().manual_seed(8)
    w = (torch.randn(96, 160, generator=gen) * 0.05).to(dtype).to(DEVICE)
    layer = on_the_fly_layer(quant, w, [96], dtype)
    want_w = quantize_weight(w)
    assert not hasattr(layer, "weight") and not hasattr(layer, "weight_packed")
    assert marlin_on_cpu["dtype"] == dtype and (marlin_on_cpu["n"], marlin_on_cpu["k"]) == (96, 160)
    assert torch.equal(marlin_on_cpu["weight"], want_w.packed) and layer.marlin_channel_scale is None
    x = torch.randn(2, 5, 160, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(96, generator=gen).to(dtype).to(DEVICE)
    y = quant.apply(layer, x, bias)
    assert y.shape == (2, 5, 96) and y.dtype == dtype
    # the stand-in rounds once to dtype, the bias adds a second rounding
    eps = torch.finfo(dtype).eps
    want = w4a16_reference(x, want_w, bias)
    torch.testing.assert_close(y.double(), want, rtol=eps, atol=eps * bias.abs().max().item())
    with pytest.raises(ValueError, match="prepared for"):
        quant.apply(layer, x.float())


def test_the_marlin_path_reads_fused_nvfp4_parts_exactly(marlin_on_cpu, one_rank):
    """A CloverLM fused layer (parts of their own tensor scales) on the marlin path: each part's W4A16 output."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    from tests.quant.quartet2.plugin.test_method import CLOVERLM_NVFP4

    config = Quartet2Config.from_config(CLOVERLM_NVFP4)
    quant = config.get_quant_method(object.__new__(ReplicatedLinear), "transformer.blocks.0.mhsa.lqkv")
    stored = [quantized(128, 128, 9 + i, scale) for i, scale in enumerate((0.02, 0.5))]
    layer = nvfp4_fused_layer(quant, stored)
    ts = torch.cat([q.tensor_scale.expand(128) for q in stored])
    assert torch.equal(layer.marlin_channel_scale * marlin_on_cpu["global_scale"], ts)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16).to(DEVICE)
    want = torch.cat([w4a16_reference(x, q) for q in stored], dim=-1)
    # Marlin's rounding to bf16, then the per-column ratio's
    torch.testing.assert_close(quant.apply(layer, x).double(), want, rtol=2 * 2**-8, atol=1e-30)


def test_nvfp4_group_is_marlins():
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import FP4_MARLIN_SUPPORTED_GROUP_SIZES

    assert FP4_MARLIN_SUPPORTED_GROUP_SIZES == [nvfp4.GROUP]
