"""The `quartet2` quantization method for vLLM: bf16 / fp16 checkpoints' linear layers quantized to NVFP4 once after
loading (Quartet II's 4/6 rule, one tensor scale per weight), or CloverLM's NVFP4 checkpoints read as they are
(quant.quartet2.checkpoint; claimed through override_quantization_method), run by one of the execution paths below,
chosen at startup ($TURBOQUANT_QUARTET2_PATH: auto, w4a4, marlin or emulate) and named in one log line with the reason.

Paths:
  `w4a4`     (Blackwell, sm100+, with vLLM's CUTLASS NVFP4 GEMM; what `auto` picks there): weights and activations in
             NVFP4 on the FP4 tensor cores, activations quantized per row (quant.quartet2.w4a4). Not yet run on a GPU:
             CPU-tested against the kernel's contract only.
  `marlin`   (Hopper / Ampere, and Blackwell without the FP4 GEMM; what `auto` picks on other CUDA GPUs where vLLM's
             Marlin FP4 runs): the NVFP4 weights, kept exact, through vLLM's Marlin FP4 kernel, activations in
             bf16 / fp16 (W4A16, quant.quartet2.marlin). Decode reads 0.28x the weight bytes of bf16.
  `emulate`  (any GPU, opt-in): activations quantized per row by the same rule, W4A4's numerics exactly, slower than
             bf16.
Where no path can run, `auto` refuses at startup and names the way out.

This module is what vLLM's registry holds, imported by the package's entry point in every vLLM process: it imports
no vLLM layers, no Triton and no kernels. The GPU probe loads when vLLM builds the config, the layers (`method`) when
it builds the model.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from . import checkpoint

if TYPE_CHECKING:
    from vllm.model_executor.layers.linear import LinearMethodBase

logger = logging.getLogger("vllm.turboquant_vllm.quartet2")

NAME = "quartet2"
PATH_ENV = "TURBOQUANT_QUARTET2_PATH"
PATHS = ("auto", "w4a4", "marlin", "emulate")


def gpu() -> tuple[int | None, bool, bool]:
    """(the CUDA device's compute capability as major * 10 + minor, None without one; whether vLLM's Marlin FP4
    kernel runs on it; whether vLLM's CUTLASS NVFP4 GEMM (W4A4) does)."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import is_fp4_marlin_supported
    from vllm.platforms import current_platform

    from . import w4a4

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


class Quartet2Config(QuantizationConfig):
    """On the fly (no config file is read: vLLM then builds the config with no arguments), or a CloverLM NVFP4
    checkpoint (from its hf_quant_config.json: `exclude` names the modules it left in 16 bits)."""

    def __init__(self, prequantized: bool = False, exclude: list[str] | None = None) -> None:
        super().__init__()
        self.prequantized = prequantized
        self.exclude = list(exclude or [])
        self.path, why = choose_path()
        logger.info("quartet2: NVFP4 path %s (%s), weights %s", self.path, why,
                    "from the NVFP4 checkpoint" if prequantized else "quantized after loading")

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Quartet2Config:
        if checkpoint.is_cloverlm_nvfp4(config):
            return cls(prequantized=True, exclude=config["quantization"].get("exclude_modules"))
        if config:
            raise ValueError(f"quartet2 quantizes bf16 / fp16 checkpoints on the fly and reads CloverLM's NVFP4 ones; "
                             f"this checkpoint is quantized otherwise ({config.get('quant_method') or config}): serve "
                             f"it without -q quartet2")
        return cls()

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None,
                                     hf_config: Any = None) -> str | None:
        """Claims CloverLM's NVFP4 checkpoints (no other method reads them), unless the user asked for another."""
        return NAME if checkpoint.is_cloverlm_nvfp4(hf_quant_cfg) and user_quant in (None, NAME) else None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> LinearMethodBase | None:
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

        from .method import Quartet2LinearMethod

        if not isinstance(layer, LinearBase):
            return None
        if self.prequantized and any(part in self.exclude for part in prefix.split(".")):
            return UnquantizedLinearMethod()
        return Quartet2LinearMethod(self)


def register() -> None:
    """`-q quartet2` for vLLM: cheap (this module's config class; its layers and kernels load when vLLM builds it)."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    register_quantization_config(NAME)(Quartet2Config)
