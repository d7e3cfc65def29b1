"""The block-scaled GEMMs' scale layout (quant.quartet2.nvfp4.blocked): the blocked offsets against a second
formulation of cuBLAS's documented layout (reshapes of 128 x 4 tiles into 32 x 16), the padded swizzle against the PTX
formula of the tcgen05 "128x4" layout and vLLM's own swizzle, round trips, and shapes outside whole tiles refused."""

import pytest
import torch

from turboquant_vllm.quant.quartet2.nvfp4 import blocked


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
    flat[blocked.blocked_offsets(rows, groups).reshape(-1)] = values.reshape(-1)
    assert torch.equal(flat, blocked_by_reshapes(values))
    assert blocked.blocked_offsets(128, 8)[33, 5].item() == 512 + 1 * 16 + 1 * 4 + 1  # second tile, row 33


def test_scales_round_trip_through_the_blocked_layout():
    scales = torch.randint(0, 127, (256, 12), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0)).view(torch.float8_e4m3fn)
    b = blocked.block_scales(scales)
    assert not torch.equal(b.view(torch.uint8), scales.view(torch.uint8))  # the layout moved them
    assert torch.equal(blocked.unblock_scales(b).view(torch.uint8), scales.view(torch.uint8))


def test_shapes_outside_whole_tiles_are_refused():
    with pytest.raises(ValueError, match="tiles of 128 rows x 4 groups"):
        blocked.blocked_offsets(100, 8)
    with pytest.raises(ValueError, match="tiles of 128 rows x 4 groups"):
        blocked.unblock_scales(torch.zeros(128, 6, dtype=torch.float8_e4m3fn))


def tile_offset(r: torch.Tensor, g: torch.Tensor, padded_groups: int) -> torch.Tensor:
    """Where scale (r, g) sits in the tcgen05 "128x4" scale-factor layout: 512-byte tiles of 128 rows x 4 groups,
    row-major over the tiles; inside one, 32 lines of 16 bytes, line r % 32, byte (r // 32 % 4) * 4 + g % 4."""
    return ((r // 128) * (padded_groups // 4) + g // 4) * 512 + (r % 32) * 16 + (r // 32 % 4) * 4 + g % 4


def read_scales(swizzled: torch.Tensor, rows: int, groups: int) -> torch.Tensor:
    flat = swizzled.reshape(-1).view(torch.uint8)
    r = torch.arange(rows, device=swizzled.device)[:, None]
    g = torch.arange(groups, device=swizzled.device)[None, :]
    return flat[tile_offset(r, g, swizzled.shape[1])].view(torch.float8_e4m3fn)


@pytest.mark.parametrize("rows, groups", [(1, 1), (5, 3), (128, 4), (130, 10), (256, 8), (300, 17)])
def test_the_swizzle_is_the_gemms_layout_and_round_trips(rows, groups):
    gen = torch.Generator().manual_seed(rows * 31 + groups)
    scales = torch.randint(0, 127, (rows, groups), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    s = blocked.swizzle_scales(scales)
    assert s.dtype == torch.float8_e4m3fn
    assert tuple(s.shape) == (blocked.round_up(rows, 128), blocked.round_up(groups, 4))
    assert torch.equal(read_scales(s, rows, groups).view(torch.uint8), scales.view(torch.uint8))
    assert torch.equal(blocked.unswizzle_scales(s, rows, groups).view(torch.uint8), scales.view(torch.uint8))
    assert int(s.view(torch.uint8).sum()) == int(scales.view(torch.uint8).sum())  # the padding is zeros
    if rows % 128 == 0 and groups % 4 == 0:  # cuBLAS's blocked layout of CloverLM's checkpoints is the same
        assert torch.equal(s.view(torch.uint8), blocked.block_scales(scales).view(torch.uint8))


def test_the_swizzle_is_vllms(monkeypatch):
    """vLLM's own swizzle_blockscale (what its NVFP4 linear kernels give the GEMM); it moves its result to CUDA."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_utils import swizzle_blockscale

    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    scales = torch.randint(0, 127, (200, 11), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(3)).view(torch.float8_e4m3fn)
    assert torch.equal(blocked.swizzle_scales(scales).view(torch.uint8), swizzle_blockscale(scales).view(torch.uint8))
