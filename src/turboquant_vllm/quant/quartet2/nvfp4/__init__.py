"""quartet2's math in plain PyTorch, the references every kernel is checked against:

    format.py    the NVFP4 format: E2M1 codes (rounding, values, packing), E4M3 group scales, NVFP4Weight
    four_six.py  Quartet II's quantization rule (the 4/6 choice per group, the tensor scale)
    blocked.py   the block-scaled GEMMs' scale layout (cuBLAS's blocked layout, CloverLM's checkpoints)

No Triton, no vLLM: importing it costs torch only.
"""

from .format import (
    E2M1_MAX,
    E2M1_VALUES,
    GROUP,
    NVFP4,
    NVFP4Weight,
    dequantize,
    e2m1_round,
    e2m1_value,
    pack,
    unpack,
)
from .four_six import pairwise_sum, quantize, tensor_scale_of

__all__ = [
    "E2M1_MAX", "E2M1_VALUES", "GROUP", "NVFP4", "NVFP4Weight", "dequantize", "e2m1_round", "e2m1_value", "pack",
    "pairwise_sum", "quantize", "tensor_scale_of", "unpack",
]
