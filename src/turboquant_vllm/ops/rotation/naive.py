"""Plain PyTorch references of the rotations into and out of the cache's basis (fp32).

ops.rotation.rotate_queries and merge_and_unrotate are tested against them.
"""

from __future__ import annotations

import torch

from ...core.calibration import KeyCalibration


def rotate_queries_reference(
    query: torch.Tensor, rotation: torch.Tensor, scale: float, key_calibration: KeyCalibration | None = None
) -> torch.Tensor:
    """Queries (tokens, q_heads, d) into the rotated basis with the key scale and `scale` folded in, fp32."""
    q = query.float() if key_calibration is None else key_calibration.queries(query)
    return (q @ rotation.T) * scale


def query_offsets_reference(query: torch.Tensor, scale: float, key_calibration: KeyCalibration) -> torch.Tensor:
    """What the attention kernels subtract from an uncentered key's score (tokens, q_heads) fp32: the rotated query
    times R mean / scale, = scale * q.mean (core.calibration)."""
    return key_calibration.query_offsets(query) * scale


def merge_and_unrotate_reference(part_acc: torch.Tensor, part_ml: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Merge split-KV partials and leave the rotated basis, fp32: part_acc (rows, splits, d) unnormalized
    outputs, part_ml (rows, 2, splits) log2-domain row maxima and row sums; rows without keys give 0."""
    m, l_part = part_ml[:, 0], part_ml[:, 1]
    w = torch.exp2(m - m.max(dim=1, keepdim=True).values).nan_to_num(0.0)  # all -inf: no key seen
    total = (w * l_part).sum(dim=1, keepdim=True)
    o = (part_acc * w.unsqueeze(-1)).sum(dim=1) / torch.where(total == 0, 1.0, total)
    return o @ rotation
