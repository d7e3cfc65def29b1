"""Quantize keys/values into the paged cache; reference: naive.store_kv_reference."""

from .store import STORE_LARGE_BATCH, store_block_tokens, store_kv

__all__ = ["STORE_LARGE_BATCH", "store_block_tokens", "store_kv"]
