"""Expand compressed pages into contiguous K/V; reference: naive.read_kv_reference."""

from .dequant import dequantize_pages

__all__ = ["dequantize_pages"]
