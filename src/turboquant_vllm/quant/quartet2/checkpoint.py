"""NVFP4 checkpoints in the format CloverLM's converter writes (IST-DASLab/CloverLM, convert_checkpoint.py --nvfp4),
read into the row-major NVFP4Weight the quartet2 paths take.

Per quantized weight `<name>` (N, K):
    <name>          float4_e2m1fn_x2 (N, K / 2): E2M1 codes, element 2i in the low nibble, sign in bit 3
    <name>_scale    float8_e4m3fn (N, K / 16): the group scales, in cuBLAS's blocked layout for block-scaled GEMMs
                    (tiles of 128 rows x 4 groups, 512 bytes each, row tiles outermost), stored as an (N, K / 16) array
    <name>_scale_2  fp32 scalar: the tensor scale
and hf_quant_config.json {"producer": {"name": "cloverlm_converter"}, "quantization": {"quant_algo": "NVFP4",
"group_size": 16, "exclude_modules": [...]}}. The blocked layout fills whole tiles only, so N must be a multiple of 128
and K of 64 (the converter pads other shapes to 128 and then cuts the padding out of the tiled scales, which leaves
them unreadable: such a checkpoint is refused).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import nvfp4

if TYPE_CHECKING:  # .linear imports Triton: the config module (every vLLM process) reads is_cloverlm_nvfp4 only
    from .linear import NVFP4Weight

TILE_ROWS = 128
TILE_GROUPS = 4
PRODUCER = "cloverlm_converter"


def blocked_offsets(rows: int, groups: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(rows, groups) int64: where scale (r, g) sits in the blocked layout. A tile is 32 x 16 bytes: row r % 32, then
    4 bytes for each of the tile's row quarters (r // 32) % 4, each byte one of its 4 groups."""
    check_tiles(rows, groups)
    r = torch.arange(rows, device=device)[:, None]
    g = torch.arange(groups, device=device)[None, :]
    tile = (r // TILE_ROWS) * (groups // TILE_GROUPS) + g // TILE_GROUPS
    return tile * 512 + (r % 32) * 16 + (r // 32 % 4) * 4 + g % TILE_GROUPS


def check_tiles(rows: int, groups: int) -> None:
    if rows % TILE_ROWS or groups % TILE_GROUPS:
        raise ValueError(f"blocked NVFP4 scales fill tiles of {TILE_ROWS} rows x {TILE_GROUPS} groups of 16: a weight "
                         f"of {rows} rows and {groups * nvfp4.GROUP} columns does not (re-convert the checkpoint "
                         f"without padding, or quantize its bf16 weights on the fly)")


def unblock_scales(blocked: torch.Tensor) -> torch.Tensor:
    """Blocked scales stored as (rows, groups) -> the same scales row-major."""
    rows, groups = blocked.shape
    flat = blocked.reshape(-1).view(torch.uint8)
    return flat[blocked_offsets(rows, groups, blocked.device)].view(blocked.dtype)


def block_scales(scales: torch.Tensor) -> torch.Tensor:
    """Row-major (rows, groups) scales -> blocked, stored as (rows, groups) (what the converter writes)."""
    rows, groups = scales.shape
    out = torch.empty(rows * groups, dtype=torch.uint8, device=scales.device)
    out[blocked_offsets(rows, groups, scales.device).reshape(-1)] = scales.reshape(-1).view(torch.uint8)
    return out.view(scales.dtype).reshape(rows, groups)


def read_weight(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> NVFP4Weight:
    """A weight's three checkpoint tensors -> NVFP4Weight (row-major scales), checked for shapes and dtypes."""
    from .linear import NVFP4Weight

    rows, half = packed.shape
    if packed.dtype not in (torch.uint8, torch.float4_e2m1fn_x2):
        raise ValueError(f"NVFP4 codes must be float4_e2m1fn_x2 or uint8, got {packed.dtype}")
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (rows, 2 * half // nvfp4.GROUP):
        raise ValueError(f"NVFP4 scales must be float8_e4m3fn ({rows}, {2 * half // nvfp4.GROUP}), got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    if scale_2.numel() != 1:
        raise ValueError(f"the NVFP4 tensor scale (_scale_2) must be one value, got shape {tuple(scale_2.shape)}")
    return NVFP4Weight(packed.view(torch.uint8), unblock_scales(scale), scale_2.to(torch.float32).reshape(()))


def is_cloverlm_nvfp4(hf_quant_config: dict | None) -> bool:
    """True for the hf_quant_config.json CloverLM's converter writes."""
    if not hf_quant_config:
        return False
    quant = hf_quant_config.get("quantization", {})
    return (hf_quant_config.get("producer", {}).get("name") == PRODUCER and quant.get("quant_algo") == "NVFP4"
            and quant.get("group_size", nvfp4.GROUP) == nvfp4.GROUP)
