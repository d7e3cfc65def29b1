"""Device-resident tables a layout's kernels read: rotation, boundaries, code values."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..core.layout import CacheLayout
from ..core.quantizer import Quantizer
from .utils import nibble_int8_asm, nibble_lookup_asm


@dataclass(frozen=True)
class KernelConstants:
    rotation: torch.Tensor  # (d, d) fp32
    rotation_fp16: torch.Tensor  # (2, d, d) fp16 with [0] + [1] = R to ~1e-7: fp16 MMAs at ~fp32 accuracy
    key_boundaries: torch.Tensor  # fp32 magnitude thresholds
    value_boundaries: torch.Tensor
    key_values: dict  # dtype -> (2^k_bits,) code values
    value_values: dict
    key_lookup_asm: str  # PTX lookup of the key codes as fp16 (ops.utils.nibble_lookup_asm; "" for 5 bits)
    value_lookup_asm: str
    key_int8: torch.Tensor | None  # 4-bit keys: (16,) int8 t per code, standing for (t + 1/2) * key_int8_step
    key_int8_step: float
    key_int8_asm: str  # PTX lookup of 4-bit key codes as int8 (ops.utils.nibble_int8_asm)

    @property
    def key_mma_asm(self) -> str:
        """The attention kernels' key decode: int8 for 4-bit keys (exact integer MMAs), fp16 otherwise."""
        return self.key_int8_asm or self.key_lookup_asm


@functools.lru_cache(maxsize=None)
def _constants(k_bits: int, v_bits: int, head_dim: int, device: torch.device) -> KernelConstants:
    kq, vq = Quantizer(k_bits, head_dim), Quantizer(v_bits, head_dim)
    # Boundaries need one entry even at 1 bit, so the kernels always get a valid pointer.
    pad = lambda b: b if b.numel() else torch.zeros(1, device=device)  # noqa: E731
    dtypes = (torch.float16, torch.bfloat16, torch.float32)  # fp32: the store's norm correction
    rotation = kq.rotation(device)
    hi = rotation.half()
    return KernelConstants(
        rotation,
        torch.stack([hi, (rotation - hi.float()).half()]),
        pad(kq.boundaries(device)),
        pad(vq.boundaries(device)),
        {dt: kq.code_values(device, dt) for dt in dtypes},
        {dt: vq.code_values(device, dt) for dt in dtypes},
        nibble_lookup_asm(_fp16_bits(kq.codebook.magnitudes), k_bits),
        nibble_lookup_asm(_fp16_bits(vq.codebook.magnitudes), v_bits),
        *_key_int8(kq, device),
    )


def _key_int8(kq: Quantizer, device: torch.device) -> tuple[torch.Tensor | None, float, str]:
    """4-bit keys: the int8 lookup table of every code, its step and the PTX that looks it up."""
    if kq.bits != 4:
        return None, 0.0, ""
    table = kq.codebook.int8_table()
    signed = table + [~t for t in table]  # sign-magnitude codes: the negative of t + 1/2 is ~t + 1/2
    return torch.tensor(signed, dtype=torch.int8, device=device), kq.codebook.int8_step, nibble_int8_asm(table)


def _fp16_bits(values) -> list[int]:
    return torch.tensor(values, dtype=torch.float16).view(torch.int16).to(torch.int32).bitwise_and(0xFFFF).tolist()


def kernel_constants(layout: CacheLayout, device: torch.device) -> KernelConstants:
    """Cached per (bits, head_dim, device): built once, before any CUDA-graph capture."""
    return _constants(layout.preset.k_bits, layout.preset.v_bits, layout.head_dim, torch.device(device))
