"""Bit packing of b-bit codes, no padding of a record beyond whole bytes.

A record of `dim` codes (dim % 8 == 0) packs into dim * bits / 8 bytes:
- 4 bits: byte j holds code 2j (low nibble) and code 2j+1 (high nibble);
- 2 bits: byte j holds codes 4j .. 4j+3, code 4j+k at bits 2k;
- 1 bit:  byte j holds codes 8j .. 8j+7, code 8j+k at bit k;
- 3 bits: two planes, the low 2 bits of every code packed as 2-bit codes (dim/4 bytes), then
  the top bit as 1-bit codes (dim/8 bytes): 8 codes in 3 bytes, and every plane decodes with
  shifts and masks of whole bytes, which is what keeps the kernels' unpacking cheap;
- 5 bits: the same with the low 4 bits as 4-bit codes (dim/2 bytes), then the top bit (dim/8).

2- and 3-bit codes store each plane byte-sliced over the dim/8 groups of 8 coordinates: byte 0 of every group,
then byte 1 of every group (a 1-bit plane, one byte a group, is unchanged). A kernel that gives element t of a tile
the coordinate pair 4 (t % (dim/8)) + t // (dim/8) (kernels.common.pair_index) then reads consecutive bytes for
consecutive elements, which the compiler pipelines; 4- and 5-bit codes need no such order (a byte of low bits per
pair).
"""

from __future__ import annotations

import torch

# (bits of the plane, bit offset of the plane in the code) for each supported width
PLANES = {1: ((1, 0),), 2: ((2, 0),), 3: ((2, 0), (1, 2)), 4: ((4, 0),), 5: ((4, 0), (1, 4))}


def record_bytes(dim: int, bits: int) -> int:
    if bits not in PLANES:
        raise ValueError(f"bits must be one of {tuple(PLANES)}, got {bits}")
    if dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 to pack codes into bytes, got {dim}")
    return dim * bits // 8


SLICED = (2, 3)  # code widths whose planes are byte-sliced (see above)


def _slice(plane: torch.Tensor, width: int) -> torch.Tensor:
    """Natural plane bytes -> byte-sliced: (groups, width bytes a group) -> (width, groups)."""
    return plane.reshape(*plane.shape[:-1], -1, width).transpose(-1, -2).reshape(plane.shape)


def _unslice(plane: torch.Tensor, width: int) -> torch.Tensor:
    return plane.reshape(*plane.shape[:-1], width, -1).transpose(-1, -2).reshape(plane.shape)


def _pack_plane(codes: torch.Tensor, width: int) -> torch.Tensor:
    per_byte = 8 // width
    grouped = codes.reshape(*codes.shape[:-1], -1, per_byte).to(torch.int32)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * width
    return (grouped << shifts).sum(-1).to(torch.uint8)


def _unpack_plane(packed: torch.Tensor, width: int) -> torch.Tensor:
    per_byte = 8 // width
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * width
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << width) - 1)
    return codes.reshape(*packed.shape[:-1], -1)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes (..., dim) integers in [0, 2^bits) -> (..., dim*bits/8) uint8."""
    record_bytes(codes.shape[-1], bits)
    planes = [_pack_plane((codes >> offset) & ((1 << width) - 1), width) for width, offset in PLANES[bits]]
    if bits in SLICED:
        planes = [_slice(plane, width) for plane, (width, _) in zip(planes, PLANES[bits])]
    return torch.cat(planes, dim=-1)


def unpack_codes(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """(..., dim*bits/8) uint8 -> codes (..., dim) int32."""
    if packed.shape[-1] != record_bytes(dim, bits):
        raise ValueError(f"expected {record_bytes(dim, bits)} bytes per record, got {packed.shape[-1]}")
    codes = torch.zeros(*packed.shape[:-1], dim, dtype=torch.int32, device=packed.device)
    start = 0
    for width, offset in PLANES[bits]:
        size = dim * width // 8
        plane = packed[..., start : start + size]
        if bits in SLICED:
            plane = _unslice(plane, width)
        codes |= _unpack_plane(plane, width) << offset
        start += size
    return codes
