"""The `quartet2` quantization method for vLLM: bf16 / fp16 checkpoints' linear layers quantized to NVFP4 once after
loading (Quartet II's 4/6 rule, one tensor scale per weight), or CloverLM's NVFP4 checkpoints read as they are
(plugin.checkpoint; claimed through override_quantization_method), run by one of the execution paths below, chosen
at startup (plugin.paths, from $TURBOQUANT_QUARTET2_PATH: auto, w4a4, marlin or emulate) and named in one log line with
the reason.

Paths:
  `w4a4`     (Blackwell, sm100+, with vLLM's CUTLASS NVFP4 GEMM; what `auto` picks there): weights and activations in
             NVFP4 on the FP4 tensor cores, activations quantized per row (kernels.w4a4). Not yet run on a GPU:
             CPU-tested against the kernel's contract only.
  `marlin`   (Hopper / Ampere, and Blackwell without the FP4 GEMM; what `auto` picks on other CUDA GPUs where vLLM's
             Marlin FP4 runs): the NVFP4 weights, kept exact, through vLLM's Marlin FP4 kernel, activations in
             bf16 / fp16 (W4A16, kernels.marlin). Decode reads 0.28x the weight bytes of bf16.
  `emulate`  (any GPU, opt-in): activations quantized per row by the same rule, W4A4's numerics exactly, slower than
             bf16 (kernels.emulate).
Where no path can run, `auto` refuses at startup and names the way out.

This module is what vLLM's registry holds, imported by the package's entry point in every vLLM process: it imports
no vLLM layers, no Triton and no kernels. The GPU probe loads when vLLM builds the config, the layers (`method`) when
it builds the model.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from .checkpoint import is_cloverlm_nvfp4
from .paths import choose_path

if TYPE_CHECKING:
    from vllm.model_executor.layers.linear import LinearMethodBase

logger = logging.getLogger("vllm.turboquant_vllm.quartet2")

NAME = "quartet2"


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
        if is_cloverlm_nvfp4(config):
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
        return NAME if is_cloverlm_nvfp4(hf_quant_cfg) and user_quant in (None, NAME) else None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> LinearMethodBase | None:
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

        from .method import Quartet2LinearMethod

        if not isinstance(layer, LinearBase):
            return None
        if self.prequantized and any(part in self.exclude for part in prefix.split(".")):
            return UnquantizedLinearMethod()
        return Quartet2LinearMethod(self.path, self.prequantized)


def register() -> None:
    """`-q quartet2` for vLLM: cheap (this module's config class; its layers and kernels load when vLLM builds it)."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    register_quantization_config(NAME)(Quartet2Config)
