"""The marlin path: NVFP4 weights through vLLM's Marlin FP4 kernel (W4A16), with the few-token kernel and the decoded
weight for cuBLAS by token count; reference: naive.w4a16_reference."""

from .marlin import (
    DENSE_ENV,
    MMA_ENV,
    MarlinNVFP4,
    VllmNVFP4,
    dense_threshold,
    marlin_flushed_groups,
    marlin_linear,
    mma_enabled,
    prepare,
    to_vllm_nvfp4,
)

__all__ = ["DENSE_ENV", "MMA_ENV", "MarlinNVFP4", "VllmNVFP4", "dense_threshold", "marlin_flushed_groups",
           "marlin_linear", "mma_enabled", "prepare", "to_vllm_nvfp4"]
