"""Paged attention over the compressed cache; reference: naive.paged_attention_reference."""

from .attention import paged_attention
from .launch import (
    MAX_DECODE_QUERY_LEN,
    AttentionLaunch,
    attention_workspace_shape,
    decode_launch,
    decode_num_splits,
    num_sms,
    split_count,
)

__all__ = [
    "MAX_DECODE_QUERY_LEN", "AttentionLaunch", "attention_workspace_shape", "decode_launch", "decode_num_splits",
    "num_sms", "paged_attention", "split_count",
]
