"""Pure PyTorch TurboQuant: codebooks, rotation, packing, presets, layouts and references.

Imports neither triton nor vllm; every kernel is tested against what lives here.
"""

from .codebook import Codebook, gaussian_limit_distortion, lloyd_max, shannon_bound
from .layout import CacheLayout
from .packing import pack_codes, record_bytes, unpack_codes
from .presets import DEFAULT_PRESET, PRESETS, Preset, get_preset
from .quantizer import Quantizer
from .rotation import rotation_matrix

__all__ = [
    "DEFAULT_PRESET",
    "PRESETS",
    "CacheLayout",
    "Codebook",
    "Preset",
    "Quantizer",
    "gaussian_limit_distortion",
    "get_preset",
    "lloyd_max",
    "pack_codes",
    "record_bytes",
    "rotation_matrix",
    "shannon_bound",
    "unpack_codes",
]
