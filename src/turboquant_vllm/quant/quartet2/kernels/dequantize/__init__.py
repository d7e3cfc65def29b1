"""NVFP4 codes and group scales -> their values, one Triton kernel, and the emulation's exact products over them;
reference: naive.unscaled_values."""

from .dequantize import exact_products, values_triton

__all__ = ["exact_products", "values_triton"]
