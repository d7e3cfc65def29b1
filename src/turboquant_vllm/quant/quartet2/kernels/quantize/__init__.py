"""Quartet II's NVFP4 quantizer as one Triton kernel; reference: naive.quantize_reference."""

from .quantize import quantize, quantize_parts, quantize_weight

__all__ = ["quantize", "quantize_parts", "quantize_weight"]
