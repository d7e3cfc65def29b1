"""Everything that depends on vLLM's internal API, for the tested range vLLM >=0.25,<0.26.

What is version-specific, and why it lives here:

- The version gate. Importing this module outside the tested range raises
  ``UnsupportedVLLMVersion`` (a RuntimeError, so vLLM's backend selector does not swallow it as
  an ImportError) naming the range; ``TURBOQUANT_ALLOW_UNSUPPORTED_VLLM=1`` turns it into a warning.
- The base classes and helpers the backend builds on (re-exported below).
- How the KV cache gets smaller. vLLM 0.25 sizes a layer's pages from the layer's KV-cache spec
  (``Attention.get_kv_cache_spec``), never from the backend. We wrap that method: for layers whose
  backend is ours it returns ``TurboQuantFullAttentionSpec`` / ``TurboQuantSlidingWindowSpec``,
  whose ``page_size_bytes`` is the compressed page (``CacheLayout.page_bytes``), with
  ``dtype=torch.uint8`` so that the runners' ``raw_int8.view(spec.dtype).view(shape)`` gives the
  byte tensor ``get_kv_cache_shape`` describes. Both subclasses resolve to vLLM's full-attention /
  sliding-window managers through the spec registry's MRO walk, so nothing needs registering.
- ``cache_dtype_str``: the 0.25 V1 runner passes ``"auto"`` to ``get_kv_cache_shape`` for specs whose
  ``kv_quant_mode`` is NONE (ours), the V2 runner does too; the backend therefore sizes pages from
  the preset it resolved itself, not from that string.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import logging
import os
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..core.layout import CacheLayout

logger = logging.getLogger("vllm.turboquant_vllm")

SUPPORTED_VLLM = ">=0.25,<0.26"
TESTED_VLLM = "0.25.0"
_LOWER, _UPPER = (0, 25), (0, 26)
ALLOW_UNSUPPORTED_ENV = "TURBOQUANT_ALLOW_UNSUPPORTED_VLLM"


class UnsupportedVLLMVersion(RuntimeError):
    """vLLM outside the range this shim was written and tested against."""


def installed_vllm_version() -> str:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))


def is_supported_vllm(version: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release
    except InvalidVersion:
        return False
    return _LOWER <= tuple(release[:2]) < _UPPER


def check_vllm_version(version: str | None = None) -> str:
    """Return the vLLM version, or raise UnsupportedVLLMVersion naming the supported range."""
    version = version or installed_vllm_version()
    if is_supported_vllm(version):
        return version
    message = (
        f"turboquant-vllm supports vLLM {SUPPORTED_VLLM} (tested with {TESTED_VLLM}); found vLLM {version}. "
        f"Install a supported vLLM (pip install 'vllm{SUPPORTED_VLLM}') or serve without "
        f"--attention-backend CUSTOM. ({ALLOW_UNSUPPORTED_ENV}=1 skips this check, at your own risk.)"
    )
    if os.environ.get(ALLOW_UNSUPPORTED_ENV) == "1":
        logger.warning("%s", message)
        return version
    raise UnsupportedVLLMVersion(message)


# The gate runs before any import of vLLM internals below.
VLLM_VERSION = check_vllm_version()

# ---------------------------------------------------------------------------------------------
# vLLM 0.25 API surface the backend builds on.
# ---------------------------------------------------------------------------------------------
from vllm.config import get_current_vllm_config_or_none  # noqa: E402
from vllm.v1.attention.backend import (  # noqa: E402
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import get_num_attention_heads_from_layers  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402

__all__ = [
    "ALLOW_UNSUPPORTED_ENV",
    "SUPPORTED_VLLM",
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionImpl",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionType",
    "CommonAttentionMetadata",
    "MultipleOf",
    "TurboQuantFullAttentionSpec",
    "TurboQuantSlidingWindowSpec",
    "UnsupportedVLLMVersion",
    "check_vllm_version",
    "config_problems",
    "current_vllm_config",
    "install_kv_cache_spec_hook",
    "layer_name_of",
    "num_compute_units",
    "num_q_heads_of_layers",
    "tensor_parallel_rank",
    "workspace_manager",
]


def current_vllm_config() -> Any | None:
    """The VllmConfig being built or run, or None outside vLLM's config context."""
    return get_current_vllm_config_or_none()


def num_q_heads_of_layers(vllm_config: Any, layer_names: list[str]) -> int:
    """Per-rank query heads of the layers of one attention group."""
    heads = get_num_attention_heads_from_layers(vllm_config, layer_names)
    if heads:
        return heads
    return vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)


def layer_name_of(impl: Any, vllm_config: Any) -> str:
    """The name vLLM registered the attention layer owning impl under (its static forward context)."""
    for name, layer in vllm_config.compilation_config.static_forward_context.items():
        if getattr(layer, "impl", None) is impl:
            return name
    raise LookupError("attention layer not found in vLLM's forward context")


def tensor_parallel_rank() -> tuple[int, int]:
    """(rank, world size) of tensor parallelism; (0, 1) outside a distributed run."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def workspace_manager() -> Any | None:
    """vLLM's shared scratch (one buffer for all layers), or None where no runner made one (unit tests)."""
    from vllm.v1.worker.workspace import current_workspace_manager, is_workspace_manager_initialized

    return current_workspace_manager() if is_workspace_manager_initialized() else None


@functools.lru_cache(maxsize=None)
@functools.cache  # asked per layer per prefill step; the answer is fixed for the process
def flash_attn_varlen() -> tuple[Any, int] | None:
    """vLLM's FlashAttention varlen function and version, or None where it cannot run (no CUDA, no build)."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    version = get_flash_attn_version()
    return (flash_attn_varlen_func, version) if version else None


def num_compute_units() -> int | None:
    """SMs of the current CUDA device, or None without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


# ---------------------------------------------------------------------------------------------
# KV-cache specs whose page is the compressed page.
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _layout(preset_name: str, head_size: int, num_kv_heads: int, block_size: int) -> "CacheLayout":
    from ..core.layout import CacheLayout
    from ..core.presets import get_preset

    return CacheLayout(get_preset(preset_name), head_size, num_kv_heads, block_size)


class _TurboQuantPage:
    """Page arithmetic shared by the two specs: one block = num_kv_heads x CacheLayout.head_page_bytes."""

    turboquant_preset: str
    head_size: int
    num_kv_heads: int
    block_size: int

    @property
    def layout(self) -> "CacheLayout":
        return _layout(self.turboquant_preset, self.head_size, self.num_kv_heads, self.block_size)

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
    from . import resolve_preset

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
    preset = resolve_preset(vllm_config).name
    # Validates head_size / block_size with a message naming the constraint.
    _layout(preset, spec.head_size, spec.num_kv_heads, spec.block_size)
    common = dict(
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        head_size_v=spec.head_size_v,
        dtype=torch.uint8,
        turboquant_preset=preset,
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
