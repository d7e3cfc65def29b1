"""The vLLM method `quartet2` (quant.quartet2.method) on the CPU: its path choice and refusals, a linear layer
created, loaded, quantized and applied as vLLM does it, equal to the emulation over the same weight."""

import pytest
import torch

from tests.conftest import DEVICE
from turboquant_vllm.quant.quartet2 import linear, method


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setenv(method.PATH_ENV, "emulate")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """vLLM's weight parameters ask for the tensor-parallel rank: a group of one process, as TP 1 has."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not model_parallel_is_initialized():
        with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device=DEVICE))):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{tmp_path_factory.mktemp('pg')}/init")
            initialize_model_parallel(1)


def test_the_path_is_chosen_or_refused_with_the_way_out(monkeypatch):
    monkeypatch.delenv(method.PATH_ENV, raising=False)
    with pytest.raises(ValueError, match=f"{method.PATH_ENV}=emulate"):
        method.Quartet2Config()
    monkeypatch.setenv(method.PATH_ENV, "fast")
    with pytest.raises(ValueError, match="choose one of auto, emulate"):
        method.choose_path()
    monkeypatch.setenv(method.PATH_ENV, "emulate")
    assert method.Quartet2Config().path == "emulate"


def test_quantized_checkpoints_are_refused(emulate):
    assert method.Quartet2Config.from_config({}).get_name() == "quartet2"
    with pytest.raises(ValueError, match="already quantized \\(awq\\)"):
        method.Quartet2Config.from_config({"quant_method": "awq"})


def test_a_layer_loads_quantizes_and_applies_as_the_emulation(emulate, one_rank):
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    config = method.Quartet2Config()
    assert isinstance(config.get_quant_method(object.__new__(ReplicatedLinear), "model.layers.0.mlp"),
                      method.Quartet2LinearMethod)
    assert config.get_quant_method(torch.nn.Embedding(4, 4), "model.embed_tokens") is None
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(48, 64, generator=gen) * 0.05).to(torch.bfloat16).to(DEVICE)
    layer = torch.nn.Module()
    quant = config.get_quant_method(object.__new__(ReplicatedLinear), "")
    with torch.device(DEVICE):
        quant.create_weights(layer, 64, [32, 16], 64, 48, torch.bfloat16, weight_loader=default_weight_loader)
    layer.weight.weight_loader(layer.weight, w)
    quant.process_weights_after_loading(layer)
    assert not hasattr(layer, "weight") and layer.weight_packed.shape == (48, 32)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn(48, generator=gen).to(torch.bfloat16).to(DEVICE)
    want = linear.emulated_linear(x, linear.quantize_weight(w), bias)
    assert torch.equal(quant.apply(layer, x, bias), want)


def test_input_features_must_group_by_16(emulate):
    quant = method.Quartet2LinearMethod(method.Quartet2Config())
    with pytest.raises(ValueError, match="multiple of 16"):
        quant.create_weights(torch.nn.Module(), 40, [16], 80, 16, torch.bfloat16, weight_loader=None)


def test_register_makes_it_a_vllm_method(emulate):
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    method.register()
    assert "quartet2" in QUANTIZATION_METHODS and get_quantization_config("quartet2") is method.Quartet2Config
