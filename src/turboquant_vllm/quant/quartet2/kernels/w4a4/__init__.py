"""The W4A4 GEMM on the FP4 tensor cores through vLLM's CUTLASS NVFP4 GEMM (the `w4a4` path, Blackwell);
reference: naive.cutlass_scaled_fp4_mm_reference (the kernel's), kernels.emulate (the path's)."""

from .w4a4 import W4A4Weight, available, prepare, w4a4_linear

__all__ = ["W4A4Weight", "available", "prepare", "w4a4_linear"]
