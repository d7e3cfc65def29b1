"""Calibrated key transform: cache (k - mean) / scale, attend with q * scale. Exact, free in bytes.

For one query, q.k and (q * s).((k - m) / s) differ by q.m, the same for every key, so softmax
(without a logit soft-cap) gives the same weights; the cache then quantizes (k - m) / s instead of k.

- The mean m (per layer and KV head) takes out the large component keys share: the quantization
  error scales with the norm of what is quantized (benchmarks/results/quality_diagnosis/cpu-reference-lm.md at
  commit 98a39d8).
- The scale s moves key energy out of the channels that queries barely read: the error of
  q.k_hat is sum_c q_c s_c e_c with e the (roughly isotropic) error of (k - m) / s, and
  E[(k_c - m_c)^2] / s_c^2 * E[q_c^2] s_c^2 balanced over channels gives
  s_c = (E[(k_c - m_c)^2] / E[q_c^2]) ^ (1/4) (Cauchy-Schwarz), normalized to geometric mean 1.

Sink-aware centering: attention-sink keys (often a sequence's first token, which many heads attend to most) have a
small norm and lie far from the mean, so (k - m) / s is large for them and so is its quantization error, where
attention concentrates. Per token the cache therefore keeps whichever of (k - m) / s and k / s is shorter, the
uncentered ones marked by a negative stored norm (free in bytes). q.k = (q * s).(k / s): for those the score
lacks the -q.m the centered ones carry, which the kernels subtract (KeyCalibration.query_offsets), so every key's
score is q.k - q.m again.

Statistics come from a run over calibration text (``turboquant-vllm calibrate``), are fitted here
and saved as safetensors: tensors ``<layer>.key_mean`` and ``<layer>.key_scale``, (kv_heads, head_dim)
fp32, one pair per attention layer, named as vLLM names the layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .quantizer import Quantizer

FORMAT = "turboquant-key-calibration/1"
_MEAN, _SCALE = "key_mean", "key_scale"
# Magnitude floor of an uncentered key's stored norm: negated, even a zero key's norm reads as uncentered.
MIN_UNCENTERED_NORM = 2.0**-100


@dataclass(frozen=True)
class KeyCalibration:
    """The key transform of one attention layer: mean and scale, each (kv_heads, head_dim) fp32."""

    mean: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.mean.dim() != 2 or self.mean.shape != self.scale.shape:
            raise ValueError(
                f"key mean and scale must both be (kv_heads, head_dim), got {tuple(self.mean.shape)} and "
                f"{tuple(self.scale.shape)}"
            )
        scale_ok = bool((self.scale > 0).all() & torch.isfinite(self.scale).all())
        if not bool(torch.isfinite(self.mean).all()) or not scale_ok:
            raise ValueError("key mean must be finite and key scale finite and positive")

    @property
    def num_kv_heads(self) -> int:
        return self.mean.shape[0]

    @property
    def head_dim(self) -> int:
        return self.mean.shape[1]

    def keys(self, key: torch.Tensor) -> torch.Tensor:
        """The centered keys (key - mean) / scale, key (tokens, kv_heads, head_dim) -> fp32 (see choose_keys)."""
        return (key.float() - self.mean.to(key.device)) / self.scale.to(key.device)

    @property
    def offset(self) -> torch.Tensor:
        """mean / scale (kv_heads, head_dim): a centered key is its uncentered one minus this."""
        return self.mean / self.scale

    def choose_keys(self, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the shorter of (key - mean) / scale and key / scale, fp32 (tokens, kv_heads, head_dim); whether it is the
        centered one, bool (tokens, kv_heads)) for key (tokens, kv_heads, head_dim); a tie takes the centered one."""
        centered = self.keys(key)
        uncentered = key.float() / self.scale.to(key.device)
        keep = centered.square().sum(-1) <= uncentered.square().sum(-1)
        return torch.where(keep[..., None], centered, uncentered), keep

    def quantize(self, quantizer: Quantizer, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the cache stores of key (tokens, kv_heads, head_dim): (packed codes, signed norms): choose_keys'
        vector quantized, its norm negated (and floored at MIN_UNCENTERED_NORM) where it is uncentered."""
        x, centered = self.choose_keys(key)
        packed, norms = quantizer.quantize(x)
        return packed, torch.where(centered, norms, -norms.clamp_min(MIN_UNCENTERED_NORM))

    def dequantize(self, quantizer: Quantizer, packed: torch.Tensor, norms: torch.Tensor,
                   rotated: bool = False) -> torch.Tensor:
        """Stored keys back as centered ones, (key - mean) / scale up to the quantization error, fp32 (tokens,
        kv_heads, head_dim); rotated: in the cache's rotated basis."""
        offset = self.offset.to(packed.device)
        if rotated:
            x = quantizer.dequantize_rotated(packed, norms.abs())
            offset = offset @ quantizer.rotation(packed.device).T
        else:
            x = quantizer.dequantize(packed, norms.abs())
        return x - (norms < 0).unsqueeze(-1) * offset

    def queries(self, query: torch.Tensor) -> torch.Tensor:
        """query (tokens, q_heads, head_dim) -> query * scale of its KV head, fp32."""
        tokens, q_heads, dim = query.shape
        grouped = query.float().view(tokens, self.num_kv_heads, q_heads // self.num_kv_heads, dim)
        return (grouped * self.scale.to(query.device)[:, None, :]).view(tokens, q_heads, dim)

    def query_offsets(self, query: torch.Tensor) -> torch.Tensor:
        """q.mean of its KV head (tokens, q_heads) fp32: what an uncentered key's score (q * scale).(k / scale)
        exceeds the centered score by (= (R (q * scale)).(R mean / scale) in the rotated basis)."""
        tokens, q_heads, dim = query.shape
        grouped = query.float().view(tokens, self.num_kv_heads, q_heads // self.num_kv_heads, dim)
        return (grouped * self.mean.to(query.device)[:, None, :]).sum(-1).view(tokens, q_heads)

    def heads(self, start: int, count: int) -> "KeyCalibration":
        """The slice for KV heads [start, start + count) (a tensor-parallel rank's heads)."""
        return KeyCalibration(self.mean[start:start + count].contiguous(), self.scale[start:start + count].contiguous())

    def to(self, device: torch.device | str) -> "KeyCalibration":
        return KeyCalibration(self.mean.to(device), self.scale.to(device))


@dataclass
class KeyStatistics:
    """Running sums over calibration tokens for one layer: keys per KV head, queries per KV group."""

    num_kv_heads: int
    head_dim: int
    key_count: int = 0
    query_count: int = 0
    key_sum: torch.Tensor = field(init=False)
    key_sq_sum: torch.Tensor = field(init=False)
    query_sq_sum: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        shape = (self.num_kv_heads, self.head_dim)
        self.key_sum, self.key_sq_sum, self.query_sq_sum = (torch.zeros(shape, dtype=torch.float64) for _ in range(3))

    def add_keys(self, key: torch.Tensor) -> None:
        """key (tokens, kv_heads, head_dim), post-RoPE as the cache receives it."""
        k = key.detach().double()
        self.key_sum += k.sum(0).cpu()
        self.key_sq_sum += k.square().sum(0).cpu()
        self.key_count += key.shape[0]

    def add_queries(self, query: torch.Tensor) -> None:
        """query (tokens, q_heads, head_dim); a KV head's group of query heads pools into its row."""
        q = query.detach().double().square().sum(0)
        self.query_sq_sum += q.view(self.num_kv_heads, -1, self.head_dim).sum(1).cpu()
        self.query_count += query.shape[0] * (query.shape[1] // self.num_kv_heads)

    def fit(self) -> KeyCalibration:
        if self.key_count < 2 or self.query_count < 1:
            raise ValueError(f"too few calibration tokens ({self.key_count} keys, {self.query_count} queries)")
        mean = self.key_sum / self.key_count
        key_var = (self.key_sq_sum / self.key_count - mean.square()).clamp_min(0)
        query_sq = self.query_sq_sum / self.query_count
        # A channel no query reads (or no key uses) would get scale 0 or inf: floor both at 1e-6 of their mean.
        key_var = key_var.clamp_min(1e-6 * key_var.mean(-1, keepdim=True) + 1e-30)
        query_sq = query_sq.clamp_min(1e-6 * query_sq.mean(-1, keepdim=True) + 1e-30)
        log_scale = 0.25 * (key_var.log() - query_sq.log())
        scale = (log_scale - log_scale.mean(-1, keepdim=True)).exp()
        return KeyCalibration(mean.float(), scale.float())


def save_calibration(path: str | Path, layers: dict[str, KeyCalibration], metadata: dict | None = None) -> None:
    from safetensors.torch import save_file

    if not layers:
        raise ValueError("no layers to save")
    tensors = {}
    for name, cal in layers.items():
        tensors[f"{name}.{_MEAN}"] = cal.mean.float().contiguous().cpu()
        tensors[f"{name}.{_SCALE}"] = cal.scale.float().contiguous().cpu()
    save_file(tensors, str(path), metadata={"format": FORMAT, "info": json.dumps(metadata or {})})


def load_calibration(path: str | Path) -> dict[str, KeyCalibration]:
    """Layer name -> KeyCalibration, from a file written by save_calibration."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"key calibration file {path} does not exist; make one with `turboquant-vllm calibrate`")
    refused = f"{path} is not a TurboQuant key calibration ({FORMAT}); make one with `turboquant-vllm calibrate`"
    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("format") != FORMAT:
                raise ValueError(refused)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as exc:  # not a safetensors file at all
        raise ValueError(f"{refused} ({exc})") from None
    names = sorted({k.rsplit(".", 1)[0] for k in tensors})
    try:
        return {n: KeyCalibration(tensors[f"{n}.{_MEAN}"].float(), tensors[f"{n}.{_SCALE}"].float()) for n in names}
    except KeyError as exc:
        raise ValueError(f"{path}: layer tensor {exc} missing") from None
