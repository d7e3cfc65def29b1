"""The marlin path's large-batch GEMM: Marlin's NVFP4 weight decoded by one Triton kernel, then one cuBLAS matmul;
reference: naive.dequantize_reference (the decoder)."""

from .marlin_dequant import DENSE_MIN_TOKENS, dense_linear, dequantize, reserve_scratch

__all__ = ["DENSE_MIN_TOKENS", "dense_linear", "dequantize", "reserve_scratch"]
