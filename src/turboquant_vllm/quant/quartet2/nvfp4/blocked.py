"""The block-scaled FP4 GEMMs' scale layout in plain PyTorch: cuBLAS's blocked layout (what CloverLM's NVFP4
checkpoints store) and the tcgen05 "128x4" scale-factor layout (what vLLM's CUTLASS NVFP4 GEMM reads) are one layout.

Tiles of 128 rows x 4 groups of 16, 512 bytes each, row tiles outermost; inside a tile, 32 lines of 16 bytes: line
r % 32, then 4 bytes for each of the tile's row quarters (r // 32) % 4, each byte one of its 4 groups. A checkpoint
fills whole tiles (blocked_offsets, block_scales, unblock_scales); the GEMM's operands are zero-padded up to them
(swizzle_scales, unswizzle_scales).
"""

from __future__ import annotations

import torch

from .format import GROUP

TILE_ROWS = 128
TILE_GROUPS = 4


def check_tiles(rows: int, groups: int) -> None:
    if rows % TILE_ROWS or groups % TILE_GROUPS:
        raise ValueError(f"blocked NVFP4 scales fill tiles of {TILE_ROWS} rows x {TILE_GROUPS} groups of 16: a weight "
                         f"of {rows} rows and {groups * GROUP} columns does not (re-convert the checkpoint "
                         f"without padding, or quantize its bf16 weights on the fly)")


def blocked_offsets(rows: int, groups: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(rows, groups) int64: where scale (r, g) sits in the blocked layout."""
    check_tiles(rows, groups)
    r = torch.arange(rows, device=device)[:, None]
    g = torch.arange(groups, device=device)[None, :]
    tile = (r // TILE_ROWS) * (groups // TILE_GROUPS) + g // TILE_GROUPS
    return tile * 512 + (r % 32) * 16 + (r // 32 % 4) * 4 + g % TILE_GROUPS


def unblock_scales(blocked: torch.Tensor) -> torch.Tensor:
    """Blocked scales stored as (rows, groups) -> the same scales row-major."""
    rows, groups = blocked.shape
    flat = blocked.reshape(-1).view(torch.uint8)
    return flat[blocked_offsets(rows, groups, blocked.device)].view(blocked.dtype)


def block_scales(scales: torch.Tensor) -> torch.Tensor:
    """Row-major (rows, groups) scales -> blocked, stored as (rows, groups) (what CloverLM's converter writes)."""
    rows, groups = scales.shape
    out = torch.empty(rows * groups, dtype=torch.uint8, device=scales.device)
    out[blocked_offsets(rows, groups, scales.device).reshape(-1)] = scales.reshape(-1).view(torch.uint8)
    return out.view(scales.dtype).reshape(rows, groups)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Row-major E4M3 group scales (R, G) -> the GEMM's (round_up(R, 128), round_up(G, 4)), zero-padded, each tile of
    128 rows x 4 groups 512 contiguous bytes (tiles row-major): row r % 32, then r // 32 % 4, then the group."""
    rows, groups = scales.shape
    padded_rows, padded_groups = round_up(rows, TILE_ROWS), round_up(groups, TILE_GROUPS)
    u8 = torch.nn.functional.pad(scales.view(torch.uint8), (0, padded_groups - groups, 0, padded_rows - rows))
    tiles = u8.reshape(padded_rows // TILE_ROWS, 4, 32, padded_groups // TILE_GROUPS, TILE_GROUPS)
    return tiles.permute(0, 3, 2, 1, 4).reshape(padded_rows, padded_groups).contiguous().view(scales.dtype)


def unswizzle_scales(swizzled: torch.Tensor, rows: int, groups: int) -> torch.Tensor:
    """swizzle_scales undone: the (rows, groups) row-major scales."""
    padded_rows, padded_groups = swizzled.shape
    tiles = swizzled.view(torch.uint8).reshape(padded_rows // TILE_ROWS, padded_groups // TILE_GROUPS, 32, 4,
                                               TILE_GROUPS)
    u8 = tiles.permute(0, 3, 2, 1, 4).reshape(padded_rows, padded_groups)
    return u8[:rows, :groups].contiguous().view(swizzled.dtype)
