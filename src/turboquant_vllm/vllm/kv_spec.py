"""KV-cache specs whose page is the compressed page, per-layer presets, and the configurations TurboQuant refuses.

vLLM 0.33 lets the backend shape a layer's KV-cache spec (``AttentionBackend.customize_spec``, which both runners
apply to every attention layer's spec). Ours (backend.py) turns the spec vLLM built into
``TurboQuantFullAttentionSpec`` / ``TurboQuantSlidingWindowSpec`` (turboquant_spec): uint8 storage of
``state_content_bytes`` = the preset's bytes per token per KV head, so a page is ``CacheLayout.page_bytes`` and the
runner's per-layer view ``[blocks, kv_heads, block_size, bytes]`` is the layout's ``(blocks, kv_heads,
head_page_bytes)`` once its last two dimensions are merged. Both subclasses resolve to vLLM's full-attention /
sliding-window managers through the spec registry's MRO walk, so nothing needs registering.

Per-layer presets (settings.LayerPresets; bind_layer_presets gives each layer its own once the model is built):
- Memory is exact. Layers of different presets have different specs, whose merge fails, so vLLM finds the specs not
  uniform and, all being full attention (or all sliding window of one size), puts every layer in one group of
  per-layer specs, ``UniformTypeKVCacheSpecs``: one block table, and a block costs the sum of the layers' pages; each
  layer gets its own tensor of its own page. The runners split the group into attention groups by (backend,
  per-layer spec), so each gets a metadata builder over its own spec and its own backend.
- bf16 layers become vLLM FlashAttention layers (its metadata builder, impl, kernels, cache layout and vLLM's own
  KV-cache spec, in the model's dtype): one group may mix backends, so those layers run what --attention-backend
  FLASH_ATTN runs, with nothing of ours to keep in step. One change: they store the step's keys/values inside
  forward, as our layers do (flash_attention_backend).
- A model mixing sliding-window and full attention layers keeps them in separate groups under vLLM's hybrid
  manager; different presets there need --disable-hybrid-kv-cache-manager (refused otherwise).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from ..core.layout import CacheLayout, cache_layout
from ..core.presets import Preset, get_preset
from . import compat
from .compat import FullAttentionSpec, SlidingWindowSpec
from .settings import BF16, LAYER_PRESETS_ENV, LayerPresets, describe_layer_presets, logger

KERNEL_BLOCK_MULTIPLE = 16  # vLLM block sizes we accept: multiples of 16 (CacheLayout needs 4)


class _TurboQuantPage:
    """Page arithmetic shared by the two specs: one block = num_kv_heads x CacheLayout.head_page_bytes."""

    turboquant_preset: str
    head_size: int
    num_kv_heads: int
    block_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.turboquant_preset and self.state_content_bytes is None:  # the page follows from the preset alone
            object.__setattr__(self, "state_content_bytes",
                               get_preset(self.turboquant_preset).bytes_per_token_per_head(self.head_size))

    @property
    def layout(self) -> CacheLayout:
        return cache_layout(get_preset(self.turboquant_preset), self.head_size, self.num_kv_heads, self.block_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TurboQuantFullAttentionSpec(_TurboQuantPage, FullAttentionSpec):
    """Full attention (optionally with a sliding window computed, not freed) over compressed pages."""

    # A default only so that FullAttentionSpec.merge, which rebuilds cls(...) from the fields it
    # knows, can run; an empty preset fails as soon as a page size is asked for.
    turboquant_preset: str = ""

    @classmethod
    def merge(cls, specs: list["TurboQuantFullAttentionSpec"]) -> "TurboQuantFullAttentionSpec":
        merged = super().merge(specs)  # asserts the fields vLLM knows agree (bf16 layers: the dtype differs)
        presets = {getattr(spec, "turboquant_preset", None) for spec in specs}
        if len(presets) != 1:
            # An AssertionError as vLLM's merges raise: is_kv_cache_spec_uniform catches only that, and vLLM then
            # groups the layers as UniformTypeKVCacheSpecs, each with its own page.
            raise AssertionError(f"layers use different TurboQuant presets: {sorted(map(str, presets))}")
        return dataclasses.replace(merged, turboquant_preset=presets.pop())


@dataclasses.dataclass(frozen=True, kw_only=True)
class TurboQuantSlidingWindowSpec(_TurboQuantPage, SlidingWindowSpec):
    """Sliding-window attention over compressed pages; blocks outside the window are freed."""

    turboquant_preset: str = ""


TURBOQUANT_SPECS = (TurboQuantFullAttentionSpec, TurboQuantSlidingWindowSpec)


# ---------------------------------------------------------------------------------------------
# Configurations the backend refuses, with the way out.
# ---------------------------------------------------------------------------------------------
def config_problems(vllm_config: Any | None) -> list[str]:
    """What in this vLLM configuration TurboQuant cannot serve; each entry names the way out."""
    if vllm_config is None:
        return []
    problems = []
    model_config = getattr(vllm_config, "model_config", None)
    cache_config = getattr(vllm_config, "cache_config", None)
    parallel_config = getattr(vllm_config, "parallel_config", None)
    if model_config is not None and getattr(model_config, "is_hybrid", False):
        problems.append(
            "hybrid attention + Mamba/linear-attention models are not supported (vLLM aligns their page sizes "
            "to uncompressed attention pages); serve this model with another --attention-backend"
        )
    if model_config is not None and getattr(model_config, "use_mla", False):
        problems.append(
            "MLA models (DeepSeek-V2/V3 style latent attention) are not supported: TurboQuant compresses "
            "per-head keys and values; serve this model with another --attention-backend"
        )
    if cache_config is not None and getattr(cache_config, "kv_cache_dtype_skip_layers", None):
        problems.append(
            "--kv-cache-dtype-skip-layers is not supported: TurboQuant compresses every attention layer; "
            "drop the option"
        )
    if parallel_config is not None:
        if getattr(parallel_config, "decode_context_parallel_size", 1) > 1 or getattr(
            parallel_config, "prefill_context_parallel_size", 1
        ) > 1:
            problems.append(
                "context parallelism (--decode-context-parallel-size / --prefill-context-parallel-size > 1) "
                "is not supported; use tensor or pipeline parallelism instead"
            )
        if getattr(parallel_config, "enable_dbo", False):
            problems.append("dual-batch overlap (--enable-dbo) is not supported; drop the option")
    return problems


# ---------------------------------------------------------------------------------------------
# The spec: what vLLM built for a layer, over compressed pages (backend.customize_spec).
# ---------------------------------------------------------------------------------------------
def is_turboquant_backend(backend: Any) -> bool:
    return bool(getattr(backend, "turboquant_backend", False))


def turboquant_spec(spec: Any, preset: Preset) -> Any:
    """The spec vLLM built for a layer, over compressed pages of ``preset``."""
    if isinstance(spec, TURBOQUANT_SPECS):
        return spec
    where = "TurboQuant (--attention-backend CUSTOM)"
    if type(spec) not in (FullAttentionSpec, SlidingWindowSpec):
        raise ValueError(
            f"{where}: this attention variant (KV-cache spec {type(spec).__name__}) is not supported; only full and "
            "sliding-window decoder attention are. Serve this model with another --attention-backend"
        )
    problems = config_problems(compat.current_vllm_config())
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))
    if spec.head_size_v != spec.head_size:
        raise ValueError(
            f"{where}: key head size {spec.head_size} differs from value head size {spec.head_size_v}; only equal "
            "K/V head sizes are supported. Serve this model with another --attention-backend"
        )
    # Validates the head size with a message naming the constraint. Not the block size: vLLM sizes a sliding-window
    # layer's blocks from a one-token spec; the backend's kernel block sizes keep the real ones multiples of 16.
    cache_layout(preset, spec.head_size, spec.num_kv_heads, KERNEL_BLOCK_MULTIPLE)
    common = dict(dtype=torch.uint8, turboquant_preset=preset.name)  # the page's bytes follow (_TurboQuantPage)
    if type(spec) is FullAttentionSpec:
        return compat.replace_as(spec, TurboQuantFullAttentionSpec, **common)
    config = compat.current_vllm_config()
    if config is not None and config.scheduler_config.disable_hybrid_kv_cache_manager:
        # vLLM would turn the window's spec into a plain (uncompressed) FullAttentionSpec; give it the full-attention
        # form of ours instead: the window is computed, its blocks are kept.
        return compat.replace_as(spec, TurboQuantFullAttentionSpec, drop=("extra_retained_tokens",), **common)
    return compat.replace_as(spec, TurboQuantSlidingWindowSpec, **common)


def check_builder_spec(spec: Any, layer_names: list[str]) -> None:
    """Last line of defence: a layer that reached our builder with an uncompressed spec."""
    if not isinstance(spec, TURBOQUANT_SPECS):
        raise ValueError(
            f"TurboQuant (--attention-backend CUSTOM): layers {layer_names[:3]}... have KV-cache spec "
            f"{type(spec).__name__}, not a TurboQuant spec, so their pages would be uncompressed. This attention "
            "variant (e.g. chunked-local, cross or reference-sliding-window attention) is not supported; "
            "serve this model with another --attention-backend"
        )


# ---------------------------------------------------------------------------------------------
# Per-layer presets: a layer's preset is known once the model is built.
# ---------------------------------------------------------------------------------------------
def bind_layer_presets(vllm_config: Any) -> None:
    """Give each TurboQuant attention layer not bound yet its preset: its entry in the settings' layer presets, else
    the settings' preset (the settings its impl carries: settings.TurboQuantSettings, one per engine).

    vLLM builds an impl without its layer's name, hence its index; the impl's process_weights_after_loading (the
    model is built, the KV cache not yet sized) calls this for all layers at once, and logs the per-layer line.
    - A TurboQuant preset: the impl takes its layout, the layer our backend's subclass for that preset, whose
      customize_spec gives the layer's spec that preset's pages.
    - bf16: the layer becomes a vLLM FlashAttention layer (module docstring).
    """
    from vllm.model_executor.layers.attention.attention import Attention

    layers = {
        name: layer for name, layer in vllm_config.compilation_config.static_forward_context.items()
        if isinstance(layer, Attention) and is_turboquant_backend(layer.attn_backend)
        and layer.attn_backend.preset_name is None
    }
    if not layers:
        return
    settings = next(iter(layers.values())).impl.settings  # the engine's settings, which every impl carries
    default, layer_presets = settings.preset, settings.layer_presets
    chosen = (dict.fromkeys(layers, default.name) if layer_presets is None
              else _layer_preset_names(vllm_config, layer_presets, default, layers))
    for name, layer in layers.items():
        if chosen[name] == BF16:
            _use_flash_attention(layer, vllm_config)
        else:
            layer.impl.bind_preset(get_preset(chosen[name]))
            layer.attn_backend = layer.attn_backend.for_preset(chosen[name])
    if layer_presets is not None:
        owners = [(layer_index(name, layer_presets.source), chosen[name], layer.num_kv_heads, layer.head_size)
                  for name, layer in layers.items() if layer.kv_sharing_target_layer_name is None]
        logger.info("%s", describe_layer_presets(owners))


def layer_index(layer_name: str, source: str) -> int:
    """The layer index in a vLLM layer name (model.layers.28.self_attn.attn -> 28), as vLLM reads it."""
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return extract_layer_index(layer_name)
    except AssertionError:
        raise ValueError(
            f"{source}: cannot tell the layer index of attention layer {layer_name!r} (vLLM's extract_layer_index "
            "needs exactly one number in the name); serve this model without per-layer presets"
        ) from None


def _layer_preset_names(vllm_config: Any, layer_presets: LayerPresets, default: Preset,
                        layers: dict[str, Any]) -> dict[str, str]:
    """Layer name -> preset name, checked against the model."""
    by_index = layer_presets.resolve(vllm_config.model_config.get_total_num_hidden_layers())

    def preset_of(name: str) -> str:
        return by_index.get(layer_index(name, layer_presets.source), default.name)

    chosen = {}
    for name, layer in layers.items():
        target = layer.kv_sharing_target_layer_name
        chosen[name] = preset_of(target or name)
        if target and preset_of(name) != chosen[name] and layer_index(name, layer_presets.source) in by_index:
            raise ValueError(
                f"{layer_presets.source}: layer {name} reads the KV cache of {target} (KV sharing), whose preset is "
                f"{chosen[name]}, not {preset_of(name)}; give both layers the same preset"
            )
    windows = {layer.sliding_window for layer in layers.values()}
    if (len(set(chosen.values())) > 1 and len(windows) > 1
            and not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager):
        raise ValueError(
            f"{layer_presets.source}: this model mixes sliding-window and full attention layers, which vLLM's hybrid "
            "KV-cache manager keeps in separate groups of one page size, while per-layer presets need them in one "
            "group: add --disable-hybrid-kv-cache-manager (sliding-window layers then keep all their blocks), or give "
            f"every layer one preset (unset {LAYER_PRESETS_ENV})"
        )
    return chosen


@functools.cache
def flash_attention_backend() -> type:
    """vLLM's FlashAttention backend for bf16 layers, storing the step's keys/values in forward as ours does
    (forward_includes_kv_cache_update). Attention.forward then traces alike in every layer whatever its preset, so
    a compiled graph that vLLM's compile cache reuses (its key holds --additional-config, not our environment
    variables) stays right when TURBOQUANT_LAYER_PRESETS changes."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

    class BF16FlashAttentionImpl(FlashAttentionImpl):
        def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor | None = None,
                    output_scale: torch.Tensor | None = None,
                    output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
            if attn_metadata is not None and self.kv_sharing_target_layer_name is None:
                # The metadata's slot mapping is not padded; the store takes that many of the padded keys.
                self.do_kv_cache_update(layer, key, value, kv_cache, attn_metadata.slot_mapping)
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)

    class BF16FlashAttentionBackend(FlashAttentionBackend):
        forward_includes_kv_cache_update: bool = True

        @staticmethod
        def get_impl_cls() -> type[BF16FlashAttentionImpl]:
            return BF16FlashAttentionImpl

    return BF16FlashAttentionBackend


def _use_flash_attention(layer: Any, vllm_config: Any) -> None:
    """Make a bf16 layer a vLLM FlashAttention layer: backend, impl (built from our impl's arguments, which passed
    our checks) and, through its backend, vLLM's own KV-cache spec."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if compat.flash_attn_varlen() is None:
        raise ValueError(
            f"layer {layer.layer_name}: bf16 layers run vLLM's FlashAttention, which cannot run here (it needs an "
            "NVIDIA GPU of compute capability 8.0 or newer); give the layer a TurboQuant preset"
        )
    ours, backend = layer.impl, flash_attention_backend()
    with set_current_vllm_config(vllm_config):
        flash = backend.get_impl_cls()(
            ours.num_heads, ours.head_size, ours.scale, ours.num_kv_heads, None, ours.sliding_window,
            ours.kv_cache_dtype, ours.softcap, ours.attn_type, ours.kv_sharing_target_layer_name,
        )
    ours.served_by = flash
    layer.impl, layer.attn_backend, layer.backend = flash, backend, AttentionBackendEnum.FLASH_ATTN
