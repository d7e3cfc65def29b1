"""CloverLM's NVFP4 checkpoints (quant.quartet2.plugin.checkpoint): a weight stored as the converter stores it read
back equal to the quantizer's, bad tensors refused, the converter's config recognised. The blocked scale layout itself:
tests/quant/quartet2/nvfp4/test_blocked.py."""

import pytest
import torch

from tests.conftest import DEVICE
from turboquant_vllm.quant.quartet2 import nvfp4
from turboquant_vllm.quant.quartet2.kernels.dequantize.naive import unscaled_values
from turboquant_vllm.quant.quartet2.kernels.quantize import quantize_weight
from turboquant_vllm.quant.quartet2.nvfp4 import blocked
from turboquant_vllm.quant.quartet2.plugin import checkpoint


def test_a_weight_round_trips_through_the_format():
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 192, generator=gen) * 0.02).to(DEVICE)  # the kernel's device (a CPU runs it interpreted)
    q = quantize_weight(w)
    stored = (q.packed.view(torch.float4_e2m1fn_x2), blocked.block_scales(q.scales), q.tensor_scale.reshape(()))
    back = checkpoint.read_weight(*stored)
    assert torch.equal(back.packed, q.packed) and torch.equal(back.scales.view(torch.uint8), q.scales.view(torch.uint8))
    ref = nvfp4.quantize(w)
    deq = unscaled_values(back.packed, back.scales) * back.tensor_scale
    torch.testing.assert_close(deq, nvfp4.dequantize(ref), rtol=2.5e-7, atol=0)


def test_bad_tensors_are_refused():
    packed = torch.zeros(128, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="float8_e4m3fn \\(128, 4\\)"):
        checkpoint.read_weight(packed, torch.zeros(128, 4), torch.tensor(1.0))
    with pytest.raises(ValueError, match="one value"):
        checkpoint.read_weight(packed, torch.zeros(128, 4, dtype=torch.float8_e4m3fn), torch.ones(2))
    with pytest.raises(ValueError, match="tiles of 128 rows x 4 groups"):
        checkpoint.read_weight(torch.zeros(100, 32, dtype=torch.uint8), torch.zeros(100, 4, dtype=torch.float8_e4m3fn),
                               torch.tensor(1.0))


def test_the_converter_config_is_recognised():
    config = {"producer": {"name": "cloverlm_converter", "version": "1.0"},
              "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["emb", "linear"]}}
    assert checkpoint.is_cloverlm_nvfp4(config)
    assert not checkpoint.is_cloverlm_nvfp4({**config, "producer": {"name": "modelopt"}})
    assert not checkpoint.is_cloverlm_nvfp4(None)
