"""Quartet II's forward NVFP4 quantizer (the "4/6" rule) in plain PyTorch: the reference every quartet2 kernel path
is checked against.

The tensor scale is amax(|x|) / (256 * 6) (1 for an all-zero x): one for the tensor (weights), or one per row
(activations: a row's codes never depend on its batch neighbours). Each group of 16 is quantized twice, with its
largest magnitude mapped to 6 (scale gmax / 6, E2M1's whole range) and to 4 (scale gmax / 4: finer steps for the bulk,
the largest values clipped to 6), and keeps the choice with the smaller squared error (the first on a tie; a group's
error summed as a pairwise tree, the order the kernels sum in, so their choices agree bit for bit). 256 * 6 leaves the
E4M3 scales <= 384 (E4M3's largest is 448) in both choices. Every rounding is to nearest, ties to even: the scales by
torch's E4M3 cast, the codes by format.e2m1_round.
"""

from __future__ import annotations

import torch

from .format import E2M1_MAX, GROUP, NVFP4, e2m1_round, e2m1_value


def _check(x: torch.Tensor) -> None:
    if x.shape[-1] % GROUP:
        raise ValueError(f"NVFP4 quantizes groups of {GROUP} along the last axis; it has {x.shape[-1]} elements")
    if not torch.isfinite(x).all():
        raise ValueError("NVFP4 input holds NaN or inf: the tensor scale (amax / 1536) would be undefined")


def tensor_scale_of(x: torch.Tensor, per_row: bool = False) -> torch.Tensor:
    """amax(|x|) / 256 / 6 in fp32, multiplied in Quartet II's order (amax * (1 / 256) * fp32(1 / 6)); 1 for an
    all-zero x. per_row: one per row of the last axis, shape (..., 1)."""
    amax = (x.abs().amax(dim=-1, keepdim=True) if per_row else x.abs().amax()).to(torch.float32)
    ts = amax * (1.0 / 256.0) * torch.tensor(1.0 / 6.0, dtype=torch.float32)
    return torch.where(amax > 0, ts, torch.ones_like(ts))


def pairwise_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis (a power of two long) as a tree of pairs: ((v0 + v1) + (v2 + v3)) + ..., keepdim."""
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v


def quantize(x: torch.Tensor, tensor_scale: torch.Tensor | None = None, per_row: bool = False) -> NVFP4:
    """x (..., K) -> NVFP4 by the 4/6 rule (Quartet II's `four_six_fp4` forward kernel, round_four_six.cu, in its
    order of operations, with exact division where it multiplies by approximate reciprocals); tensor_scale: a given
    one (e.g. a weight's), else tensor_scale_of(x, per_row). The squared errors are compared in units of the tensor
    scale (|x| / tensor_scale <= 1536), so huge inputs cannot overflow them; divisions keep subnormal inputs finite."""
    _check(x)
    x = x.to(torch.float32)
    ts = tensor_scale_of(x, per_row) if tensor_scale is None else torch.as_tensor(
        tensor_scale, dtype=torch.float32, device=x.device)
    tensor_ts, ts = ts, ts.unsqueeze(-1) if ts.dim() else ts  # per row: (..., 1, 1) against the groups
    groups = x.reshape(*x.shape[:-1], -1, GROUP)
    gmax = groups.abs().amax(dim=-1, keepdim=True)
    units = groups / ts
    best_codes = best_scale = best_err = None
    for target in (E2M1_MAX, 4.0):
        s_group = gmax * torch.tensor(1.0 / target, dtype=torch.float32)
        scale = (s_group / ts).to(torch.float8_e4m3fn)
        fp8s = scale.to(torch.float32)
        codes = e2m1_round(groups / (torch.where(fp8s > 0, fp8s, torch.ones_like(fp8s)) * ts))
        err = pairwise_sum((e2m1_value(codes) * fp8s - units) ** 2)
        if best_err is None:
            best_codes, best_scale, best_err = codes, scale.view(torch.uint8), err
        else:  # a tie keeps the first choice (6)
            better = err < best_err
            best_codes = torch.where(better, codes, best_codes)
            best_scale = torch.where(better, scale.view(torch.uint8), best_scale)
            best_err = torch.minimum(err, best_err)
    return NVFP4(best_codes.reshape(x.shape), best_scale.squeeze(-1).view(torch.float8_e4m3fn), tensor_ts)


