"""The marlin path's few-token GEMM, a native CUDA kernel (marlin_mma.cu, built once by `python -m
turboquant_vllm.quant.quartet2.kernels.marlin_mma build`) over Marlin's NVFP4 words; reference: naive.emulate (its
arithmetic, bit for bit). Importing it imports torch, never Triton (`turboquant-vllm verify` reads native.py)."""

from .marlin_mma import (
    MAX_CLUSTER,
    MAX_TOKENS,
    POLICY_TOKENS,
    clusters,
    gemm,
    reserve_workspace,
    split_plan,
    supported,
    zero_flushed_codes,
)

__all__ = ["MAX_CLUSTER", "MAX_TOKENS", "POLICY_TOKENS", "clusters", "gemm", "reserve_workspace", "split_plan",
           "supported", "zero_flushed_codes"]
