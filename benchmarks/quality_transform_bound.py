"""How much could a learned linear transform of K or V cut the quantization error? A bound, no quantizer run.

The cache quantizes x = A (k - m) with an error e of roughly isotropic variance proportional to E||x||^2 (random
rotation, norm stored per vector) and attends with A^-T q, so the score error is q . A^-1 e and its mean square is
proportional to tr(M S_k) tr(M^-1 S_q), M = A^T A, S_k the centered key covariance, S_q the queries' second moment
(the KV head's query heads). Over diagonal M (what core.calibration's scale is) the minimum is (sum_c sqrt(S_k,cc
S_q,cc))^2; over all M it is tr((S_k^1/2 S_q S_k^1/2)^1/2)^2 (M the geometric mean of S_k^-1 and S_q). Values: the
output error of query head j is W_j e (W_j its o_proj columns), so S_q becomes G = sum_j W_j^T W_j.
Printed: each bound over the untransformed one, per layer and KV head, and summed, on held-out windows of the
reference LM (post-RoPE q and k, as the cache sees them).

    python -m benchmarks quality_transform_bound [--windows 2] [--seq-len 2048]
Prints its findings after a provenance header (log: benchmarks/results/quality_diagnosis/).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from reference_lm.model import apply_rope, rope_cos_sin

from . import common
from . import quality_diagnosis as qd
from .common import ROOT

NAME = "quality_transform_bound"


def sqrtm(a: torch.Tensor) -> torch.Tensor:
    w, u = torch.linalg.eigh(a)
    return (u * w.clamp(min=0).sqrt()) @ u.T


def bounds(cov: torch.Tensor, weight: torch.Tensor) -> tuple[float, float, float]:
    """Mean-square error bounds (no transform, best diagonal, best matrix) for error covariance tr(M cov) M^-1
    read through `weight`: tr(M cov) tr(M^-1 weight)."""
    none = torch.trace(cov) * torch.trace(weight)
    diag = (torch.diag(cov) * torch.diag(weight)).sqrt().sum() ** 2
    r = sqrtm(cov)
    full = torch.trace(sqrtm(r @ weight @ r)) ** 2
    return none.item(), diag.item(), full.item()


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "reference-lm")
    ap.add_argument("--val", type=Path, default=ROOT / "build" / "reference_lm" / "val.bin")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    args = ap.parse_args(argv)
    common.print_header(common.command_line(NAME, argv))
    model = qd.load_model(args.model)
    val = np.fromfile(args.val, dtype=np.uint16)
    t = args.seq_len
    starts = np.random.default_rng(1).integers(0, len(val) - t, args.windows)
    ids = torch.tensor(np.stack([np.concatenate([[qd.BOS], val[s:s + t - 1]]) for s in starts]).astype(np.int64))
    totals = {"keys": np.zeros(3), "values": np.zeros(3)}
    with torch.no_grad():
        inputs: list = []
        qd.forward(model, ids, None, inputs=inputs)
        cos, sin = rope_cos_sin(model.config, t, ids.device)
        for i, layer in enumerate(model.model.layers):
            at = layer.self_attn
            x = layer.input_layernorm(inputs[i])
            b, d, g = x.shape[0], at.head_dim, at.n_heads // at.n_kv
            q = apply_rope(at.q_proj(x).view(b, t, at.n_heads, d).transpose(1, 2), cos, sin).double()
            k = apply_rope(at.k_proj(x).view(b, t, at.n_kv, d).transpose(1, 2), cos, sin).double()
            v = at.v_proj(x).view(b, t, at.n_kv, d).transpose(1, 2).double()
            wo = at.o_proj.weight.double()
            for h in range(at.n_kv):
                kc = k[:, h].reshape(-1, d)
                kc = kc - kc.mean(0)
                qh = q[:, h * g:(h + 1) * g].reshape(-1, d)
                vc = v[:, h].reshape(-1, d)
                vc = vc - vc.mean(0)
                gram = sum(wo[:, j * d:(j + 1) * d].T @ wo[:, j * d:(j + 1) * d] for j in range(h * g, (h + 1) * g))
                for name, cov, weight in (("keys", kc.T @ kc / len(kc), qh.T @ qh / len(qh)),
                                          ("values", vc.T @ vc / len(vc), gram)):
                    none, diag, full = bounds(cov, weight)
                    totals[name] += (none, diag, full)
                    print(f"layer {i} KV head {h} {name:6s}: best diagonal / none {diag / none:.3f}, "
                          f"best matrix / none {full / none:.3f}, best matrix / best diagonal {full / diag:.3f}")
    for name, (none, diag, full) in totals.items():
        print(f"all layers, {name}: best diagonal / none {diag / none:.3f}, best matrix / none {full / none:.3f}, "
              f"best matrix / best diagonal {full / diag:.3f}")


if __name__ == "__main__":
    main()
