"""Triton kernels over the compressed paged KV cache, one folder per op, each with its plain-PyTorch reference
(`naive.py`) beside it:

    store/      quantize new keys/values into their page slots (and rotate a decode step's queries)
    attention/  paged attention over the compressed pages: decode kernel, general kernel, launch policy
    rotation/   into the cache's basis (queries) and out of it (outputs, merging the split partials)
    dequant/    expand pages into contiguous K/V in the model's basis (long prefills run FlashAttention on them)

utils.py holds the Triton pieces the kernels share (byte-permute lookups, page offsets, argument checks),
constants.py the device tables per layout, warmup.py the compile-before-serving launches.
"""

from .attention import attention_workspace_shape, decode_launch, decode_num_splits, paged_attention
from .dequant import dequantize_pages
from .rotation import RotatedQuery, merge_and_unrotate, rotate_queries
from .store import store_kv
from .warmup import warm_up

__all__ = [
    "RotatedQuery", "attention_workspace_shape", "decode_launch", "decode_num_splits", "dequantize_pages",
    "merge_and_unrotate", "paged_attention", "rotate_queries", "store_kv", "warm_up",
]

