"""What a TurboQuant engine serves with: the preset, per-layer presets and the key calibration, from
--additional-config or the environment, resolved once per engine into one TurboQuantSettings; the startup log lines.
Imports no vLLM module (``register()`` runs it in every vLLM process).

    TURBOQUANT_PRESET=tq3                     or  --additional-config '{"turboquant_preset": "tq3"}'
    TURBOQUANT_LAYER_PRESETS='0,1,-2,-1=bf16;5-7=k4v3'
                                              or  --additional-config '{"turboquant_layer_presets":
                                                                       {"0,1,-2,-1": "bf16", "5-7": "k4v3"}}'
    TURBOQUANT_KEY_CALIBRATION=keys.safetensors  or  --additional-config '{"turboquant_key_calibration": "..."}'

Giving a setting both ways with the same value is fine; with different values it is an error. --additional-config is
the channel vLLM keys its compile cache by; `turboquant-vllm serve --preset` passes the preset there.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.calibration import KeyCalibration, KeyStatistics, load_calibration
from ..core.layout import cache_layout
from ..core.presets import DEFAULT_PRESET, PRESETS, UNQUANTIZED, Preset, get_preset

PRESET_ENV = "TURBOQUANT_PRESET"
PRESET_CONFIG_KEY = "turboquant_preset"  # key of vLLM's --additional-config
LAYER_PRESETS_ENV = "TURBOQUANT_LAYER_PRESETS"
LAYER_PRESETS_CONFIG_KEY = "turboquant_layer_presets"
BF16 = UNQUANTIZED  # served by vLLM's FlashAttention
CALIBRATION_ENV = "TURBOQUANT_KEY_CALIBRATION"
CALIBRATION_CONFIG_KEY = "turboquant_key_calibration"
# Set by `turboquant-vllm calibrate` only: the backend then sums key/query statistics per layer.
COLLECT_ENV = "TURBOQUANT_COLLECT_KEY_STATISTICS"

# A child of vLLM's "vllm" logger, so our lines come out through vLLM's handler and format.
logger = logging.getLogger("vllm.turboquant_vllm")

_logged: set[tuple] = set()  # what was logged or warmed up once per process
key_statistics: dict[str, KeyStatistics] = {}  # layer name -> sums, while COLLECT_ENV is set


_LAYER_ITEM = re.compile(r"(-?\d+)(?:-(-?\d+))?")  # 5, -1, 5-7, 28--1: an index or an inclusive range


@dataclass(frozen=True)
class LayerPresets:
    """Per-layer presets as given: (layers as written, their (first, last) spans, preset name) per entry. Indices
    below 0 count from the end; resolve() maps them onto a model's layers."""

    source: str  # where they were given, for messages
    entries: tuple[tuple[str, tuple[tuple[int, int], ...], str], ...]

    def turboquant_presets(self) -> set[Preset]:
        return {get_preset(name) for _, _, name in self.entries if name != BF16}

    def resolve(self, num_layers: int) -> dict[int, str]:
        """Layer index -> preset name, for a model of num_layers layers; layers not named keep the preset."""
        chosen: dict[int, tuple[str, str]] = {}  # index -> (entry as written, preset name)
        for text, spans, name in self.entries:
            for first, last in spans:
                lo, hi = (i + num_layers if i < 0 else i for i in (first, last))
                if not (0 <= lo < num_layers and 0 <= hi < num_layers):
                    raise ValueError(
                        f"{self.source}: layers {text!r} reach past the model's {num_layers} layers "
                        f"(0..{num_layers - 1}, or -{num_layers}..-1 from the end); fix the entry"
                    )
                if lo > hi:
                    raise ValueError(
                        f"{self.source}: range in {text!r} is empty ({lo} > {hi}); write ranges first-last"
                    )
                for index in range(lo, hi + 1):
                    if index in chosen:
                        raise ValueError(
                            f"{self.source}: layer {index} is in two entries ({chosen[index][0]!r} and {text!r}); "
                            "give each layer one preset"
                        )
                    chosen[index] = (text, name)
        return {index: name for index, (_, name) in chosen.items()}

    def check(self, head_size: int, num_layers: int | None) -> None:
        """Refuse presets that cannot serve head_size and, once the model's number of layers is known, indices out
        of range or given twice: a ValueError naming the constraint and the way out."""
        for text, _, name in self.entries:
            if name == BF16:
                continue
            try:
                cache_layout(get_preset(name), head_size, 1, 16)  # the head-size limits (any block size)
            except ValueError as exc:
                raise ValueError(
                    f"{self.source} gives layers {text} preset {name}, which this model cannot use: {exc}; or give "
                    "those layers another preset (e.g. tq4 or bf16)"
                ) from None
        if num_layers is not None:
            self.resolve(num_layers)


def parse_layer_presets(value: Any, source: str) -> LayerPresets | None:
    """Layer presets from a JSON object {"0,1,-1": "bf16", "5-7": "k4v3"} (--additional-config) or the string
    "0,1,-1=bf16;5-7=k4v3" (environment); None when empty."""
    if isinstance(value, str):
        pairs = []
        for part in filter(None, (p.strip() for p in value.split(";"))):
            layers, sep, name = part.partition("=")
            if not sep:
                raise ValueError(f"{source}: entry {part!r} is not LAYERS=PRESET (e.g. '0,1,-2,-1=bf16;5-7=k4v3')")
            pairs.append((layers, name))
    elif isinstance(value, dict):
        pairs = [(str(layers), str(name)) for layers, name in value.items()]
    else:
        # A configuration error like the others, which callers report as ValueError.
        raise ValueError(f'{source}: expected a JSON object {{"LAYERS": "PRESET", ...}}, got {value!r}')  # noqa: TRY004
    entries = []
    for layers, name in pairs:
        layers, name = layers.strip(), name.strip().lower()
        spans = []
        for item in layers.split(","):
            match = _LAYER_ITEM.fullmatch(item.strip())
            if match is None:
                raise ValueError(
                    f"{source}: {layers!r} is not a list of layer indices and ranges (e.g. '0,1,5-7' or '-2,-1')"
                )
            spans.append((int(match[1]), int(match[2] or match[1])))
        if name != BF16 and name not in PRESETS:
            raise ValueError(
                f"{source}: unknown preset {name!r} for layers {layers}; choose {BF16} or one of {', '.join(PRESETS)}"
            )
        entries.append((layers, tuple(spans), name))
    return LayerPresets(source, tuple(entries)) if entries else None


def num_model_layers(vllm_config: Any | None) -> int | None:
    """The model's number of layers (all pipeline stages: layer names count from 0 across them); None without one."""
    model_config = getattr(vllm_config, "model_config", None)
    return None if model_config is None else model_config.get_total_num_hidden_layers()


# ---------------------------------------------------------------------------------------------
# The settings of one engine
# ---------------------------------------------------------------------------------------------
DEFAULT_SOURCE = "default"


@dataclass(frozen=True)
class TurboQuantSettings:
    """What one engine serves with, each with where it was given (for messages)."""

    preset: Preset  # every TurboQuant layer's, unless layer_presets gives it another
    preset_source: str  # "--additional-config turboquant_preset", "TURBOQUANT_PRESET" or "default"
    layer_presets: LayerPresets | None = None
    calibration_path: str | None = None
    calibration_source: str | None = None

    def turboquant_presets(self) -> set[Preset]:
        """Every TurboQuant preset a layer may take (what the workspace and the warm-up must cover)."""
        return {self.preset, *(self.layer_presets.turboquant_presets() if self.layer_presets else ())}

    def describe(self) -> str:
        """One line: what `vllm serve` does with these settings."""
        where = "the default" if self.preset_source == DEFAULT_SOURCE else f"from {self.preset_source}"
        parts = [f"preset: {self.preset.name} ({where})"]
        if self.layer_presets is not None:
            entries = " ".join(f"{text}={name}" for text, _, name in self.layer_presets.entries)
            parts.append(f"layer presets: {entries} (from {self.layer_presets.source}; the other layers "
                         f"{self.preset.name})")
        parts.append("key calibration: " + (f"{self.calibration_path} (from {self.calibration_source})"
                                            if self.calibration_path else "none"))
        return "; ".join(parts)


def _config_value(extra: Any, config_key: str) -> Any:
    return extra.get(config_key) if isinstance(extra, Mapping) else None


def _config_text(extra: Any, config_key: str) -> str | None:
    value = _config_value(extra, config_key)
    return None if value is None else str(value).strip() or None


def _env_value(environ: Mapping[str, str], env: str) -> str | None:
    return environ.get(env, "").strip() or None


def _resolve_preset(extra: Any, environ: Mapping[str, str]) -> tuple[Preset, str]:
    config_value = _config_text(extra, PRESET_CONFIG_KEY)
    env_value = _env_value(environ, PRESET_ENV)
    source = f"--additional-config {PRESET_CONFIG_KEY}" if config_value else PRESET_ENV if env_value else DEFAULT_SOURCE
    try:
        if config_value and env_value and get_preset(config_value) != get_preset(env_value):
            raise ValueError(
                f"TurboQuant preset given twice: --additional-config {PRESET_CONFIG_KEY}={config_value!r} and "
                f"{PRESET_ENV}={env_value!r}; keep one of them"
            )
        return get_preset(config_value or env_value or DEFAULT_PRESET), source
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def _resolve_layer_presets(extra: Any, environ: Mapping[str, str]) -> LayerPresets | None:
    config_value = _config_value(extra, LAYER_PRESETS_CONFIG_KEY)
    from_config = (parse_layer_presets(config_value, f"--additional-config {LAYER_PRESETS_CONFIG_KEY}")
                   if config_value else None)
    env_value = environ.get(LAYER_PRESETS_ENV, "")
    from_env = parse_layer_presets(env_value, LAYER_PRESETS_ENV)
    if from_config and from_env and (
        {entry[1:] for entry in from_config.entries} != {entry[1:] for entry in from_env.entries}
    ):
        raise ValueError(
            f"TurboQuant layer presets given twice: --additional-config {LAYER_PRESETS_CONFIG_KEY}={config_value!r} "
            f"and {LAYER_PRESETS_ENV}={env_value!r}; keep one of them"
        )
    return from_config or from_env


def _resolve_calibration(extra: Any, environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    config_value = _config_text(extra, CALIBRATION_CONFIG_KEY)
    env_value = _env_value(environ, CALIBRATION_ENV)
    if config_value and env_value and os.path.abspath(config_value) != os.path.abspath(env_value):
        raise ValueError(
            f"TurboQuant key calibration given twice: --additional-config {CALIBRATION_CONFIG_KEY}={config_value!r} "
            f"and {CALIBRATION_ENV}={env_value!r}; keep one of them"
        )
    if config_value:
        return config_value, f"--additional-config {CALIBRATION_CONFIG_KEY}"
    return env_value, CALIBRATION_ENV if env_value else None


def resolve_settings(additional_config: Any = None, environ: Mapping[str, str] | None = None) -> TurboQuantSettings:
    """The one resolver: the settings vLLM's --additional-config (a dict; None: none) and the environment give, each
    validated; a ValueError naming the setting, the constraint and the way out otherwise. Model-dependent checks
    (layer indices, head sizes) wait for the model: LayerPresets.check."""
    environ = os.environ if environ is None else environ
    preset, preset_source = _resolve_preset(additional_config, environ)
    layer_presets = _resolve_layer_presets(additional_config, environ)
    calibration_path, calibration_source = _resolve_calibration(additional_config, environ)
    return TurboQuantSettings(preset, preset_source, layer_presets, calibration_path, calibration_source)


# One TurboQuantSettings per engine: vLLM asks for them once per layer (the backend selector, every impl, the spec
# hook), always with the engine's VllmConfig. A VllmConfig is unhashable, so the cache is keyed by its identity and
# the entry dropped when the config is collected; nothing here outlives the engine's config.
_engine_settings: dict[int, TurboQuantSettings] = {}


def engine_settings(vllm_config: Any | None) -> TurboQuantSettings:
    """The settings of the engine vllm_config configures, resolved on first use (None: the environment alone)."""
    if vllm_config is None:
        return resolve_settings(None)
    key = id(vllm_config)
    settings = _engine_settings.get(key)
    if settings is None:
        settings = resolve_settings(getattr(vllm_config, "additional_config", None))
        weakref.finalize(vllm_config, _engine_settings.pop, key, None)
        _engine_settings[key] = settings
    return settings


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


def _index_ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5, 28, 29] -> "0-2,5,28-29" """
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def describe_layer_presets(layers: list[tuple[int, str, int, int]]) -> str:
    """The startup line with per-layer presets: which layers use which preset, and the KV-cache bytes per token summed
    over the layers vs the same layers in bf16. layers: (index, preset name, KV heads, head size) each."""
    indices: dict[str, list[int]] = {}
    total = bf16 = 0
    for index, name, heads, head_size in sorted(layers):
        indices.setdefault(name, []).append(index)
        plain = heads * 2 * 2 * head_size
        bf16 += plain
        total += plain if name == BF16 else heads * get_preset(name).bytes_per_token_per_head(head_size)
    presets = "; ".join(f"{name} {_index_ranges(found)}" for name, found in indices.items())
    return (
        f"TurboQuant KV cache per layer: {presets}: {total:,} B per token over {len(layers)} layers vs {bf16:,} B in "
        f"bf16 -> {bf16 / total:.2f}x KV-cache capacity"
    )


def first_time(*key: Any) -> bool:
    """True the first time this key is asked in the process (what is logged or warmed up once)."""
    if key in _logged:
        return False
    _logged.add(key)
    return True
