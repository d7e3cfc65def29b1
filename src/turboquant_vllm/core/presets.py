"""KV-cache presets: bits for keys and values, and their bytes per token per KV head."""

from __future__ import annotations

from dataclasses import dataclass

from .packing import record_bytes

NORM_BYTES = 4  # one fp32 norm per vector


@dataclass(frozen=True)
class Preset:
    name: str
    k_bits: int
    v_bits: int
    summary: str

    def key_record_bytes(self, head_dim: int) -> int:
        return record_bytes(head_dim, self.k_bits) + NORM_BYTES

    def value_record_bytes(self, head_dim: int) -> int:
        return record_bytes(head_dim, self.v_bits) + NORM_BYTES

    def bytes_per_token_per_head(self, head_dim: int) -> int:
        """K and V of one token of one KV head: codes + one fp32 norm each."""
        return self.key_record_bytes(head_dim) + self.value_record_bytes(head_dim)

    def capacity_vs_bf16(self, head_dim: int) -> float:
        return 2 * 2 * head_dim / self.bytes_per_token_per_head(head_dim)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("tq4", 4, 4, "4-bit keys and values (default)"),
        Preset("tq3", 3, 3, "3-bit keys and values"),
        Preset("k4v3", 4, 3, "4-bit keys, 3-bit values"),
        Preset("k3v2", 3, 2, "3-bit keys, 2-bit values (2.5 bits on average)"),
        Preset("tq2", 2, 2, "2-bit keys and values"),
        Preset("k5v4", 5, 4, "5-bit keys, 4-bit values (quality first)"),
    )
}
DEFAULT_PRESET = "tq4"
UNQUANTIZED = "bf16"  # a per-layer choice besides the presets: K/V kept in the model's own 16-bit dtype


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown TurboQuant preset {name!r}; choose one of {', '.join(PRESETS)}") from None
