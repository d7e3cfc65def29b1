"""NVFP4 checkpoints in the format CloverLM's converter writes (IST-DASLab/CloverLM, convert_checkpoint.py --nvfp4),
read into the row-major NVFP4Weight the quartet2 paths take.

Per quantized weight `<name>` (N, K):
    <name>          float4_e2m1fn_x2 (N, K / 2): E2M1 codes, element 2i in the low nibble, sign in bit 3
    <name>_scale    float8_e4m3fn (N, K / 16): the group scales, in cuBLAS's blocked layout for block-scaled GEMMs
                    (nvfp4.blocked: tiles of 128 rows x 4 groups, 512 bytes each, row tiles outermost), stored as an
                    (N, K / 16) array
    <name>_scale_2  fp32 scalar: the tensor scale
and hf_quant_config.json {"producer": {"name": "cloverlm_converter"}, "quantization": {"quant_algo": "NVFP4",
"group_size": 16, "exclude_modules": [...]}}. The blocked layout fills whole tiles only, so N must be a multiple of 128
and K of 64 (the converter pads other shapes to 128 and then cuts the padding out of the tiled scales, which leaves
them unreadable: such a checkpoint is refused).
"""

from __future__ import annotations

import torch

from .. import nvfp4
from ..nvfp4 import NVFP4Weight, blocked

PRODUCER = "cloverlm_converter"


def read_weight(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> NVFP4Weight:
    """A weight's three checkpoint tensors -> NVFP4Weight (row-major scales), checked for shapes and dtypes."""
    rows, half = packed.shape
    if packed.dtype not in (torch.uint8, torch.float4_e2m1fn_x2):
        raise ValueError(f"NVFP4 codes must be float4_e2m1fn_x2 or uint8, got {packed.dtype}")
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (rows, 2 * half // nvfp4.GROUP):
        raise ValueError(f"NVFP4 scales must be float8_e4m3fn ({rows}, {2 * half // nvfp4.GROUP}), got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    if scale_2.numel() != 1:
        raise ValueError(f"the NVFP4 tensor scale (_scale_2) must be one value, got shape {tuple(scale_2.shape)}")
    return NVFP4Weight(packed.view(torch.uint8), blocked.unblock_scales(scale), scale_2.to(torch.float32).reshape(()))


def is_cloverlm_nvfp4(hf_quant_config: dict | None) -> bool:
    """True for the hf_quant_config.json CloverLM's converter writes."""
    if not hf_quant_config:
        return False
    quant = hf_quant_config.get("quantization", {})
    return (hf_quant_config.get("producer", {}).get("name") == PRODUCER and quant.get("quant_algo") == "NVFP4"
            and quant.get("group_size", nvfp4.GROUP) == nvfp4.GROUP)
