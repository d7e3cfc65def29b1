"""KV-cache specs whose page is the compressed page, and the configurations TurboQuant refuses.

vLLM 0.25 sizes a layer's pages from the layer's KV-cache spec (``Attention.get_kv_cache_spec``), never from the
backend. install_kv_cache_spec_hook wraps that method: for layers whose backend is ours it returns
``TurboQuantFullAttentionSpec`` / ``TurboQuantSlidingWindowSpec``, whose ``page_size_bytes`` is the compressed page
(``CacheLayout.page_bytes``), with ``dtype=torch.uint8`` so that the runners' ``raw_int8.view(spec.dtype).view(shape)``
gives the byte tensor ``get_kv_cache_shape`` describes. Both subclasses resolve to vLLM's full-attention /
sliding-window managers through the spec registry's MRO walk, so nothing needs registering. Other backends' layers
are untouched.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from ..core.layout import CacheLayout, cache_layout
from ..core.presets import get_preset
from .compat import FullAttentionSpec, SlidingWindowSpec
from .settings import resolve_preset


class _TurboQuantPage:
    """Page arithmetic shared by the two specs: one block = num_kv_heads x CacheLayout.head_page_bytes."""

    turboquant_preset: str
    head_size: int
    num_kv_heads: int
    block_size: int

    @property
    def layout(self) -> CacheLayout:
        return cache_layout(get_preset(self.turboquant_preset), self.head_size, self.num_kv_heads, self.block_size)

    @property
    def real_page_size_bytes(self) -> int:
        return self.layout.page_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class TurboQuantFullAttentionSpec(_TurboQuantPage, FullAttentionSpec):
    """Full attention (optionally with a sliding window computed, not freed) over compressed pages."""

    # A default only so that FullAttentionSpec.merge, which rebuilds cls(...) from the fields it
    # knows, can run; an empty preset fails as soon as a page size is asked for.
    turboquant_preset: str = ""

    @classmethod
    def merge(cls, specs: list["TurboQuantFullAttentionSpec"]) -> "TurboQuantFullAttentionSpec":
        presets = {spec.turboquant_preset for spec in specs}
        if len(presets) != 1:
            raise ValueError(f"layers of one KV-cache group use different TurboQuant presets: {sorted(presets)}")
        return dataclasses.replace(super().merge(specs), turboquant_preset=presets.pop())


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
# The hook: Attention.get_kv_cache_spec returns the compressed spec for our layers.
# ---------------------------------------------------------------------------------------------
def is_turboquant_backend(backend: Any) -> bool:
    return bool(getattr(backend, "turboquant_backend", False))


def turboquant_kv_cache_spec(layer: Any, vllm_config: Any, spec: Any) -> Any:
    """Translate the spec vLLM chose for ``layer`` into the same spec over compressed pages."""
    if spec is None:  # encoder-only layers keep no KV cache
        return None
    name = getattr(layer, "layer_name", "?")
    where = f"TurboQuant (--attention-backend CUSTOM), layer {name}"
    if type(spec) not in (FullAttentionSpec, SlidingWindowSpec):
        raise ValueError(
            f"{where}: this attention variant ({type(layer).__name__}, KV-cache spec {type(spec).__name__}) is not "
            "supported; only full and sliding-window decoder attention are. Serve this model with another "
            "--attention-backend"
        )
    problems = config_problems(vllm_config)
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))
    if spec.head_size_v != spec.head_size:
        raise ValueError(
            f"{where}: key head size {spec.head_size} differs from value head size {spec.head_size_v}; only equal "
            "K/V head sizes are supported. Serve this model with another --attention-backend"
        )
    preset = resolve_preset(vllm_config)
    # Validates head_size / block_size with a message naming the constraint.
    cache_layout(preset, spec.head_size, spec.num_kv_heads, spec.block_size)
    common = dict(
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        head_size_v=spec.head_size_v,
        dtype=torch.uint8,
        turboquant_preset=preset.name,
    )
    if type(spec) is FullAttentionSpec:
        return TurboQuantFullAttentionSpec(
            block_size=spec.block_size,
            sliding_window=spec.sliding_window,
            attention_chunk_size=spec.attention_chunk_size,
            non_causal=spec.non_causal,
            **common,
        )
    # Sliding window: same block size as the full-attention layers, so every page has one size.
    block_size = vllm_config.cache_config.block_size
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        # vLLM would turn a SlidingWindowSpec into a plain (uncompressed) FullAttentionSpec; give it
        # the full-attention form of ours instead: the window is computed, its blocks are kept.
        return TurboQuantFullAttentionSpec(block_size=block_size, sliding_window=spec.sliding_window, **common)
    return TurboQuantSlidingWindowSpec(block_size=block_size, sliding_window=spec.sliding_window, **common)


def install_kv_cache_spec_hook() -> None:
    """Wrap Attention.get_kv_cache_spec once per process (idempotent); other backends are untouched."""
    from vllm.model_executor.layers.attention.attention import Attention

    current = Attention.get_kv_cache_spec
    if getattr(current, "__turboquant_hook__", False):
        return
    original = current

    @functools.wraps(original)
    def get_kv_cache_spec(self: Any, vllm_config: Any) -> Any:
        spec = original(self, vllm_config)
        if not is_turboquant_backend(getattr(self, "attn_backend", None)):
            return spec
        return turboquant_kv_cache_spec(self, vllm_config, spec)

    get_kv_cache_spec.__turboquant_hook__ = True  # type: ignore[attr-defined]
    get_kv_cache_spec.__turboquant_original__ = original  # type: ignore[attr-defined]
    Attention.get_kv_cache_spec = get_kv_cache_spec  # type: ignore[method-assign]


def check_builder_spec(spec: Any, layer_names: list[str]) -> None:
    """Last line of defence: a layer that reached our builder with an uncompressed spec."""
    if not isinstance(spec, TURBOQUANT_SPECS):
        raise ValueError(
            f"TurboQuant (--attention-backend CUSTOM): layers {layer_names[:3]}... have KV-cache spec "
            f"{type(spec).__name__}, not a TurboQuant spec, so their pages would be uncompressed. This attention "
            "variant (e.g. chunked-local, cross or reference-sliding-window attention) is not supported; "
            "serve this model with another --attention-backend"
        )
