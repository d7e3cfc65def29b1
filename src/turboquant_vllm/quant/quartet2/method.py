"""The `quartet2` quantization method for vLLM: bf16 / fp16 checkpoints' linear layers quantized to NVFP4 once after
loading (Quartet II's 4/6 rule, one tensor scale per weight), run by one of the execution paths below, chosen at
startup and named in one log line with the reason.

Paths built: `emulate` (any GPU: activations quantized per row by the same rule, W4A4's numerics exactly, slower than
bf16). Not built yet: Blackwell's FP4 tensor cores (W4A4) and Hopper's Marlin FP4 (W4A16); until they are, `auto`
refuses at startup and names the way to the emulation.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.parameter import ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

from . import nvfp4
from .linear import NVFP4Weight, emulated_linear, quantize_weight

logger = logging.getLogger("vllm.turboquant_vllm.quartet2")

NAME = "quartet2"
PATH_ENV = "TURBOQUANT_QUARTET2_PATH"
PATHS = ("auto", "emulate")


def choose_path() -> tuple[str, str]:
    """(path, why) from $TURBOQUANT_QUARTET2_PATH; ValueError naming the way out where no path can run."""
    requested = os.environ.get(PATH_ENV, "auto")
    if requested not in PATHS:
        raise ValueError(f"{PATH_ENV}={requested!r}: choose one of {', '.join(PATHS)}")
    if requested == "emulate":
        return "emulate", f"{PATH_ENV}=emulate: W4A4 numerics exactly, activations quantized per row"
    raise ValueError(
        "quartet2 runs NVFP4 only as exact emulation in this version (W4A4 numerics, slower than bf16): the FP4 "
        f"tensor-core (Blackwell) and Marlin FP4 (Hopper) paths are not built yet. Set {PATH_ENV}=emulate to run it, "
        "or serve the bf16 checkpoint without -q quartet2.")


class Quartet2Config(QuantizationConfig):
    """Quantizes on the fly: no config file is read (vLLM then builds the config with no arguments)."""

    def __init__(self) -> None:
        super().__init__()
        self.path, why = choose_path()
        logger.info("quartet2: NVFP4 path %s (%s)", self.path, why)

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
        if config:
            raise ValueError(f"quartet2 quantizes bf16 / fp16 checkpoints on the fly; this checkpoint is already "
                             f"quantized ({config.get('quant_method', config)}): serve it without -q quartet2")
        return cls()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Quartet2LinearMethod | None:
        return Quartet2LinearMethod(self) if isinstance(layer, LinearBase) else None


class Quartet2LinearMethod(LinearMethodBase):
    """bf16 weights loaded as vLLM loads them (sharded, fused), then NVFP4: 0.28x their bytes."""

    def __init__(self, config: Quartet2Config) -> None:
        self.config = config

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        if input_size_per_partition % nvfp4.GROUP:
            raise ValueError(f"quartet2: NVFP4 scales groups of {nvfp4.GROUP} input features; this layer has "
                             f"{input_size_per_partition} per tensor-parallel rank. Use a tensor-parallel size "
                             f"that keeps it a multiple of {nvfp4.GROUP}, or serve without -q quartet2")
        weight_loader = extra_weight_attrs.pop("weight_loader")
        weight = ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            input_dim=1, output_dim=0, weight_loader=weight_loader)
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w = quantize_weight(layer.weight.data)
        del layer.weight  # the bf16 copy goes: only the NVFP4 weight stays
        layer.register_buffer("weight_packed", w.packed, persistent=False)
        layer.register_buffer("weight_scales", w.scales, persistent=False)
        layer.register_buffer("weight_tensor_scale", w.tensor_scale, persistent=False)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = NVFP4Weight(layer.weight_packed, layer.weight_scales, layer.weight_tensor_scale)
        return emulated_linear(x, weight, bias)


def register() -> None:
    """`-q quartet2` for vLLM (cheap: the config and its kernels load when vLLM builds a model with it)."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    register_quantization_config(NAME)(Quartet2Config)
