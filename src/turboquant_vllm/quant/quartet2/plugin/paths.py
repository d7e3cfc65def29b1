"""quartet2's execution path, chosen once at startup from $TURBOQUANT_QUARTET2_PATH (auto, w4a4, marlin or emulate)
and the GPU, with the reason the config logs: `auto` takes the fastest path this GPU runs (w4a4 on Blackwell with
vLLM's CUTLASS NVFP4 GEMM, marlin on other CUDA GPUs where vLLM's Marlin FP4 runs) and refuses, naming the way out,
where none does.
"""

from __future__ import annotations

import os

PATH_ENV = "TURBOQUANT_QUARTET2_PATH"
PATHS = ("auto", "w4a4", "marlin", "emulate")


def gpu() -> tuple[int | None, bool, bool]:
    """(the CUDA device's compute capability as major * 10 + minor, None without one; whether vLLM's Marlin FP4
    kernel runs on it; whether vLLM's CUTLASS NVFP4 GEMM (W4A4) does)."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import is_fp4_marlin_supported
    from vllm.platforms import current_platform

    from ..kernels import w4a4

    capability = current_platform.get_device_capability() if current_platform.is_cuda() else None
    capability = capability.to_int() if capability is not None else None
    return capability, bool(is_fp4_marlin_supported()), w4a4.available(capability)


def choose_path() -> tuple[str, str]:
    """(path, why) from $TURBOQUANT_QUARTET2_PATH and the GPU; ValueError naming the way out where no path can
    run."""
    requested = os.environ.get(PATH_ENV, "auto")
    if requested not in PATHS:
        raise ValueError(f"{PATH_ENV}={requested!r}: choose one of {', '.join(PATHS)}")
    if requested == "emulate":
        return "emulate", f"{PATH_ENV}=emulate: W4A4 numerics exactly, activations quantized per row"
    capability, marlin_ok, w4a4_ok = gpu()
    sm = f"sm{capability}" if capability is not None else "no CUDA GPU"
    w4a4_why = "NVFP4 weights and activations (per row) on the FP4 tensor cores through vLLM's CUTLASS NVFP4 GEMM"
    if requested == "w4a4" or (requested == "auto" and w4a4_ok):
        if w4a4_ok:
            return "w4a4", f"{requested} on {sm}: {w4a4_why}"
        lack = ("no FP4 tensor cores (they need sm100+, Blackwell)" if capability is None or capability < 100
                else "this vLLM build has no CUTLASS NVFP4 GEMM for it")
        raise ValueError(f"quartet2: {PATH_ENV}=w4a4 cannot run here ({sm}: {lack}). Set {PATH_ENV}=auto (the "
                         f"fastest path this GPU runs), marlin (NVFP4 weights, bf16 activations) or emulate (W4A4 "
                         f"numerics exactly, any GPU).")
    if not marlin_ok:
        raise ValueError(
            f"quartet2: vLLM's Marlin FP4 kernel (NVFP4 weights, bf16 activations) does not run here ({sm}; it needs "
            f"an NVIDIA GPU of sm75 or newer and vLLM's CUDA kernels), nor does the FP4 tensor-core path (W4A4, "
            f"sm100+ with vLLM's CUTLASS NVFP4 GEMM). Set {PATH_ENV}=emulate for the exact emulation (any GPU, "
            f"slower than bf16), or serve the bf16 checkpoint without -q quartet2.")
    if requested == "marlin":
        return "marlin", f"{PATH_ENV}=marlin on {sm}: NVFP4 weights through vLLM's Marlin FP4, activations unquantized"
    if capability is not None and capability >= 100:
        return "marlin", (f"auto on {sm}: FP4 tensor cores present but this vLLM build has no CUTLASS NVFP4 GEMM "
                          f"for them; NVFP4 weights through vLLM's Marlin FP4 (W4A16)")
    return "marlin", f"auto on {sm}: no FP4 tensor cores; NVFP4 weights through vLLM's Marlin FP4 (W4A16)"
