"""Triton kernels over the compressed paged KV cache; each names its reference in core/."""

from .attention import attention_workspace_shape, default_num_splits, paged_attention
from .dequant import dequantize_pages
from .rotation import merge_and_unrotate, rotate_queries
from .store import store_kv
from .warmup import warm_up

__all__ = [
    "attention_workspace_shape", "default_num_splits", "dequantize_pages", "merge_and_unrotate", "paged_attention",
    "rotate_queries", "store_kv", "warm_up",
]
