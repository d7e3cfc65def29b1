"""Everything that depends on vLLM's internal API, for the tested range vLLM >=0.33,<0.34.

- The version gate (requirements.check_vllm_version). Importing this module outside the tested range raises
  ``UnsupportedVLLMVersion`` naming the range; ``TURBOQUANT_ALLOW_UNSUPPORTED_VLLM=1`` turns it into a warning.
- The base classes and helpers the backend builds on (re-exported below).
- How the KV cache gets smaller: the backend's ``customize_spec`` (see kv_spec).
"""

from __future__ import annotations

import functools
from typing import Any

from .requirements import (
    ALLOW_UNSUPPORTED_ENV,
    SUPPORTED_VLLM,
    TESTED_VLLM,
    UnsupportedVLLMVersion,
    check_vllm_version,
    installed_vllm_version,
    is_supported_vllm,
)

# The gate runs before any import of vLLM internals below.
VLLM_VERSION = check_vllm_version()

# ---------------------------------------------------------------------------------------------
# vLLM 0.33 API surface the backend builds on.
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
    max_decode_query_len,
)
from vllm.v1.attention.backends.utils import (  # noqa: E402
    get_num_attention_heads_from_layers,
    split_decodes_and_prefills,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec, replace_as  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

# Layouts that keep each (block, KV head) page contiguous, blocks at any stride.
BLOCK_CONTIGUOUS_LAYOUTS = tuple(layout for layout in KVCacheLayout if layout.is_block_contiguous)

__all__ = [
    "ALLOW_UNSUPPORTED_ENV",
    "SUPPORTED_VLLM",
    "TESTED_VLLM",
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionImpl",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionType",
    "BLOCK_CONTIGUOUS_LAYOUTS",
    "CommonAttentionMetadata",
    "MultipleOf",
    "max_decode_query_len",
    "FullAttentionSpec",
    "SlidingWindowSpec",
    "replace_as",
    "UnsupportedVLLMVersion",
    "check_vllm_version",
    "installed_vllm_version",
    "is_supported_vllm",
    "current_vllm_config",
    "flash_attn_varlen",
    "layer_name_of",
    "num_q_heads_of_layers",
    "split_decodes_and_prefills",
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


def batch_invariant() -> bool:
    """vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1): a request's outputs must not depend on its batch."""
    from vllm import envs

    return bool(envs.VLLM_BATCH_INVARIANT)


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
