"""CloverLM's NVFP4 checkpoint format (quant.quartet2.checkpoint): the blocked scale layout against a second
formulation of cuBLAS's documented layout (reshapes of 128 x 4 tiles into 32 x 16), round trips, a weight read back
equal to the quantizer's, and the refusals."""

import pytest
import torch

from tests.conftest import DEVICE
from turboquant_vllm.quant.quartet2 import checkpoint, linear, nvfp4


def blocked_by_reshapes(s: torch.Tensor) -> torch.Tensor:
    """cuBLAS's block-scaling layout: 128 x 4 tiles, row tiles outermost; inside a tile, (row quarter, row % 32,
    group) stored as (row % 32, row quarter, group)."""
    rows, groups = s.shape
    tiles = s.view(rows // 128, 128, groups // 4, 4).permute(0, 2, 1, 3)
    return tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1)


@pytest.mark.parametrize("rows,groups", [(128, 4), (256, 12), (384, 8)])
def test_blocked_offsets_are_cublas_layout(rows, groups):
    values = torch.arange(rows * groups).reshape(rows, groups)
    flat = torch.empty(rows * groups, dtype=torch.long)
    flat[checkpoint.blocked_offsets(rows, groups).reshape(-1)] = values.reshape(-1)
    assert torch.equal(flat, blocked_by_reshapes(values))
    assert checkpoint.blocked_offsets(128, 8)[33, 5].item() == 512 + 1 * 16 + 1 * 4 + 1  # second tile, row 33


def test_a_weight_round_trips_through_the_format():
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 192, generator=gen) * 0.02).to(DEVICE)  # the kernel's device (a CPU runs it interpreted)
    q = linear.quantize_weight(w)
    blocked = checkpoint.block_scales(q.scales)
    assert not torch.equal(blocked.view(torch.uint8), q.scales.view(torch.uint8))  # the layout moved them
    stored = (q.packed.view(torch.float4_e2m1fn_x2), blocked, q.tensor_scale.reshape(()))
    back = checkpoint.read_weight(*stored)
    assert torch.equal(back.packed, q.packed) and torch.equal(back.scales.view(torch.uint8), q.scales.view(torch.uint8))
    ref = nvfp4.quantize(w)
    deq = linear.unscaled_values(back.packed, back.scales) * back.tensor_scale
    torch.testing.assert_close(deq, nvfp4.dequantize(ref), rtol=2.5e-7, atol=0)


def test_shapes_outside_whole_tiles_and_bad_tensors_are_refused():
    with pytest.raises(ValueError, match="tiles of 128 rows x 4 groups"):
        checkpoint.blocked_offsets(100, 8)
    with pytest.raises(ValueError, match="tiles of 128 rows x 4 groups"):
        checkpoint.unblock_scales(torch.zeros(128, 6, dtype=torch.float8_e4m3fn))
    packed = torch.zeros(128, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="float8_e4m3fn \\(128, 4\\)"):
        checkpoint.read_weight(packed, torch.zeros(128, 4), torch.tensor(1.0))
    with pytest.raises(ValueError, match="one value"):
        checkpoint.read_weight(packed, torch.zeros(128, 4, dtype=torch.float8_e4m3fn), torch.ones(2))


def test_the_converter_config_is_recognised():
    config = {"producer": {"name": "cloverlm_converter", "version": "1.0"},
              "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["emb", "linear"]}}
    assert checkpoint.is_cloverlm_nvfp4(config)
    assert not checkpoint.is_cloverlm_nvfp4({**config, "producer": {"name": "modelopt"}})
    assert not checkpoint.is_cloverlm_nvfp4(None)
