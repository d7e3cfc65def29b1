"""What a TurboQuant process serves with: the preset and the key calibration, from --additional-config or the
environment, fixed once per process; the startup log lines. Imports no vLLM module (``register()`` runs it in every
vLLM process).

    TURBOQUANT_PRESET=tq3                     or  --additional-config '{"turboquant_preset": "tq3"}'
    TURBOQUANT_KEY_CALIBRATION=keys.safetensors  or  --additional-config '{"turboquant_key_calibration": "..."}'

Giving a setting both ways with different values is an error.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from ..core.calibration import KeyCalibration, KeyStatistics, load_calibration
from ..core.presets import DEFAULT_PRESET, Preset, get_preset

PRESET_ENV = "TURBOQUANT_PRESET"
PRESET_CONFIG_KEY = "turboquant_preset"  # key of vLLM's --additional-config
CALIBRATION_ENV = "TURBOQUANT_KEY_CALIBRATION"
CALIBRATION_CONFIG_KEY = "turboquant_key_calibration"
# Set by `turboquant-vllm calibrate` only: the backend then sums key/query statistics per layer.
COLLECT_ENV = "TURBOQUANT_COLLECT_KEY_STATISTICS"

# A child of vLLM's "vllm" logger, so our lines come out through vLLM's handler and format.
logger = logging.getLogger("vllm.turboquant_vllm")

_process_preset: Preset | None = None
_logged: set[tuple] = set()  # what was logged or warmed up once per process
key_statistics: dict[str, KeyStatistics] = {}  # layer name -> sums, while COLLECT_ENV is set


def _setting(vllm_config: Any | None, config_key: str, env: str) -> tuple[str | None, str | None]:
    extra = getattr(vllm_config, "additional_config", None)
    config_value = None
    if isinstance(extra, dict) and extra.get(config_key) is not None:
        config_value = str(extra[config_key]).strip() or None
    return config_value, os.environ.get(env, "").strip() or None


def resolve_preset(vllm_config: Any | None = None) -> Preset:
    """The preset asked for: ``--additional-config`` key, else ``TURBOQUANT_PRESET``, else tq4."""
    config_value, env_value = _setting(vllm_config, PRESET_CONFIG_KEY, PRESET_ENV)
    try:
        if config_value and env_value and get_preset(config_value) != get_preset(env_value):
            raise ValueError(
                f"TurboQuant preset given twice: --additional-config {PRESET_CONFIG_KEY}={config_value!r} and "
                f"{PRESET_ENV}={env_value!r}; keep one of them"
            )
        return get_preset(config_value or env_value or DEFAULT_PRESET)
    except ValueError as exc:
        source = f"--additional-config {PRESET_CONFIG_KEY}" if config_value else PRESET_ENV
        raise ValueError(f"{source}: {exc}") from None


def process_preset(vllm_config: Any | None = None) -> Preset:
    """The preset of this process: resolved from the first config seen, then fixed, so that the KV-cache spec
    (engine side) and get_kv_cache_shape (worker side, which gets no config) agree."""
    global _process_preset
    if vllm_config is None:
        if _process_preset is not None:
            return _process_preset
        from .compat import current_vllm_config

        vllm_config = current_vllm_config()
    preset = resolve_preset(vllm_config)
    if _process_preset is None:
        _process_preset = preset
    elif preset != _process_preset:
        raise ValueError(
            f"TurboQuant preset changed within one process ({_process_preset.name} -> {preset.name}); "
            "set it once, through TURBOQUANT_PRESET or --additional-config"
        )
    return preset


def resolve_calibration_path(vllm_config: Any | None = None) -> str | None:
    """The key calibration file: ``--additional-config`` key, else ``TURBOQUANT_KEY_CALIBRATION``, else none."""
    config_value, env_value = _setting(vllm_config, CALIBRATION_CONFIG_KEY, CALIBRATION_ENV)
    if config_value and env_value and os.path.abspath(config_value) != os.path.abspath(env_value):
        raise ValueError(
            f"TurboQuant key calibration given twice: --additional-config {CALIBRATION_CONFIG_KEY}={config_value!r} "
            f"and {CALIBRATION_ENV}={env_value!r}; keep one of them"
        )
    return config_value or env_value


read_calibration = functools.lru_cache(maxsize=None)(load_calibration)  # once per process, shared by all layers


def rank_kv_heads(total: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(first, count) of the KV heads a tensor-parallel rank holds; vLLM replicates them when total < tp_size."""
    if total >= tp_size:
        return rank * (total // tp_size), total // tp_size
    return rank * total // tp_size, 1


def layer_calibration(path: str, layer_name: str, num_kv_heads: int, head_dim: int, rank: int = 0,
                      tp_size: int = 1) -> KeyCalibration:
    """The part of layer_name's key calibration in the file at path that a tensor-parallel rank serves."""
    layers = read_calibration(path)
    if layer_name not in layers:
        raise ValueError(
            f"key calibration {path} has no layer {layer_name!r} (it has {len(layers)}, e.g. {next(iter(layers))!r}); "
            f"it was made for another model: run `turboquant-vllm calibrate` for this one, or unset {CALIBRATION_ENV}"
        )
    cal = layers[layer_name]
    first, count = rank_kv_heads(cal.num_kv_heads, tp_size, rank)
    if cal.head_dim != head_dim or count != num_kv_heads:
        raise ValueError(
            f"key calibration {path} has {cal.num_kv_heads} KV heads of dim {cal.head_dim} for {layer_name}, but this "
            f"rank serves {num_kv_heads} of dim {head_dim} (tensor parallel size {tp_size}); it was made for another "
            "model: run `turboquant-vllm calibrate` for this one"
        )
    return cal.heads(first, count)


def describe_preset(preset: Preset, head_dim: int) -> str:
    """The one startup line: preset, bytes per token per KV head and the gain over bf16."""
    tq = preset.bytes_per_token_per_head(head_dim)
    bf16 = 2 * 2 * head_dim
    return (
        f"TurboQuant KV cache: preset {preset.name} ({preset.k_bits}-bit K, {preset.v_bits}-bit V), "
        f"head_dim {head_dim}: {tq} B per token per KV head vs {bf16} B in bf16 -> "
        f"{bf16 / tq:.2f}x KV-cache capacity"
    )


def first_time(*key: Any) -> bool:
    """True the first time this key is asked in the process (what is logged or warmed up once)."""
    if key in _logged:
        return False
    _logged.add(key)
    return True
