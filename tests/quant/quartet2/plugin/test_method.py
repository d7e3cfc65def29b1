"""The vLLM method `quartet2` (quant.quartet2.plugin.config and .method) on the CPU: its refusals, a linear layer
created, loaded, quantized and applied as vLLM does it, equal to the emulation over the same weight (the path choice:
test_paths.py; the marlin path: kernels/test_marlin.py and kernels/test_gpu_marlin.py; w4a4: kernels/test_w4a4.py)."""

import pytest
import torch

from tests.conftest import DEVICE
from tests.quant.quartet2.plugin.layers import nvfp4_fused_layer, on_the_fly_layer
from turboquant_vllm.quant.quartet2.kernels.emulate import emulated_linear
from turboquant_vllm.quant.quartet2.kernels.quantize import quantize_parts, quantize_weight
from turboquant_vllm.quant.quartet2.plugin import method, paths
from turboquant_vllm.quant.quartet2.plugin.config import Quartet2Config, register


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setenv(paths.PATH_ENV, "emulate")


def test_quantized_checkpoints_are_refused(emulate):
    assert Quartet2Config.from_config({}).get_name() == "quartet2"
    with pytest.raises(ValueError, match="quantized otherwise \\(awq\\)"):
        Quartet2Config.from_config({"quant_method": "awq"})


def test_a_layer_loads_quantizes_and_applies_as_the_emulation(emulate, one_rank):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    config = Quartet2Config()
    assert isinstance(config.get_quant_method(object.__new__(ReplicatedLinear), "model.layers.0.mlp"),
                      method.Quartet2LinearMethod)
    assert config.get_quant_method(torch.nn.Embedding(4, 4), "model.embed_tokens") is None
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(48, 64, generator=gen) * 0.05).to(torch.bfloat16).to(DEVICE)
    quant = config.get_quant_method(object.__new__(ReplicatedLinear), "")
    layer = on_the_fly_layer(quant, w, [32, 16], torch.bfloat16)
    assert not hasattr(layer, "weight") and layer.weight_packed.shape == (48, 32)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn(48, generator=gen).to(torch.bfloat16).to(DEVICE)
    # the fused parts (rows 0..31, 32..47) quantized as the model's own two linears: a tensor scale each
    first, second = quantize_weight(w[:32]), quantize_weight(w[32:])
    assert torch.equal(layer.weight_tensor_scale, torch.cat([first.tensor_scale.expand(32),
                                                             second.tensor_scale.expand(16)]))
    assert torch.equal(layer.weight_packed, torch.cat([first.packed, second.packed]))
    want = emulated_linear(x, quantize_parts(w, [32, 16]), bias)
    assert torch.equal(quant.apply(layer, x, bias), want)


def test_input_features_must_group_by_16(emulate):
    quant = method.Quartet2LinearMethod("emulate")
    with pytest.raises(ValueError, match="multiple of 16"):
        quant.create_weights(torch.nn.Module(), 40, [16], 80, 16, torch.bfloat16, weight_loader=None)


def test_register_makes_it_a_vllm_method(emulate):
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    register()
    assert "quartet2" in QUANTIZATION_METHODS and get_quantization_config("quartet2") is Quartet2Config


CLOVERLM_NVFP4 = {"producer": {"name": "cloverlm_converter", "version": "1.0"},
                  "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                   "exclude_modules": ["emb", "linear"]}}


def test_cloverlm_nvfp4_checkpoints_are_claimed_unless_another_method_was_asked(emulate):
    assert Quartet2Config.override_quantization_method(CLOVERLM_NVFP4, None) == "quartet2"
    assert Quartet2Config.override_quantization_method(CLOVERLM_NVFP4, "quartet2") == "quartet2"
    assert Quartet2Config.override_quantization_method(CLOVERLM_NVFP4, "awq") is None
    assert Quartet2Config.override_quantization_method({"quant_method": "awq"}, None) is None
    config = Quartet2Config.from_config(CLOVERLM_NVFP4)
    assert config.prequantized and config.exclude == ["emb", "linear"]


def test_a_fused_layer_reads_the_nvfp4_checkpoint(emulate, one_rank):
    """Two parts of 128 rows, each quantized with its own tensor scale and stored as the converter stores them, loaded
    as a merged column-parallel layer loads them: the output is each part's emulation, side by side."""
    from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod

    config = Quartet2Config.from_config(CLOVERLM_NVFP4)
    assert isinstance(config.get_quant_method(object.__new__(ReplicatedLinear), "transformer.linear"),
                      UnquantizedLinearMethod)
    quant = config.get_quant_method(object.__new__(ReplicatedLinear), "transformer.blocks.0.mhsa.lqkv")
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(128, 128, generator=gen) * scale for scale in (0.02, 0.5)]
    stored = [quantize_weight(w.to(DEVICE)) for w in parts]
    layer = nvfp4_fused_layer(quant, stored, codes=lambda p: p.view(torch.float4_e2m1fn_x2).view(torch.uint8))
    assert not hasattr(layer, "weight_scale") and layer.weight_tensor_scale.shape == (256,)
    x = torch.randn(3, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    want = torch.cat([emulated_linear(x, q) for q in stored], dim=-1)
    torch.testing.assert_close(quant.apply(layer, x), want, rtol=0, atol=0)


def test_nvfp4_checkpoints_need_whole_tiles_and_no_input_split(emulate, one_rank):
    quant = method.Quartet2LinearMethod("emulate", prequantized=True)
    with pytest.raises(ValueError, match="whole 128 x 64 scale tiles"):
        quant.create_weights(torch.nn.Module(), 128, [96], 128, 96, torch.bfloat16, weight_loader=None)
    with pytest.raises(ValueError, match="tensor-parallel-size 1"):
        quant.create_weights(torch.nn.Module(), 64, [128], 128, 128, torch.bfloat16, weight_loader=None)


def test_a_layer_returns_the_free_segments_before_its_lasting_tensors(emulate, one_rank, monkeypatch):
    """vLLM loads with the allocator's max_split_size_mb at 20 (blocks of 20 MiB or more handed out unsplit): each layer
    empties the CUDA cache before quantizing and again before its lasting tensors are made; on the CPU, nothing."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    seen = []
    real = method._return_free_segments
    monkeypatch.setattr(method, "_return_free_segments", lambda device: (seen.append(device.type), real(device)))
    quant = Quartet2Config().get_quant_method(object.__new__(ReplicatedLinear), "")
    on_the_fly_layer(quant, torch.zeros(16, 32, dtype=torch.bfloat16, device=DEVICE), [16], torch.bfloat16)
    assert seen == [torch.device(DEVICE).type] * 2
    assert len(emptied) == (2 if torch.device(DEVICE).type == "cuda" else 0)
    real(torch.device("cuda"))
    assert emptied[-1:] == [True]
