"""Triton kernels over the compressed paged KV cache; each names its reference in core/."""

from .attention import attention_workspace_shape, default_num_splits, paged_attention
from .store import store_kv

__all__ = ["attention_workspace_shape", "default_num_splits", "paged_attention", "store_kv"]
