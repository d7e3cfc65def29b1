"""The `awq_turbomind` quantization method for vLLM: AutoAWQ GEMM checkpoints (int4, group 128, zero points) with
every quantized linear layer run by TurboMind's int4 GEMM kernels (the `turbomind` 0.0.2 wheel) instead of vLLM's own
AWQ kernels.

Weights load as vLLM's AWQ method loads them (its parameter classes, so fused QKV / gate-up and tensor-parallel
sharding go through vLLM's loaders), are repacked once into TurboMind's layout after loading, and the AWQ tensors are
freed. The kernel runs behind one torch custom op with a fake implementation, so torch.compile and full CUDA graphs
see an ordinary op. TurboMind's kernels take fp16 activations only: bf16 models are cast at the layer's boundary.

Installing the package changes nothing for `vllm serve <AWQ model>`: the method claims an AWQ checkpoint only when
asked for (`-q awq_turbomind`) or opted into ($TURBOQUANT_AWQ_TURBOMIND=1); what it cannot run is refused at startup
with the way out.

This module is what vLLM's registry holds, imported by the package's entry point in every vLLM process: its config
class reads and checks AWQ configs with no vLLM layers, no turbomind and no torch op imported. Those are in
quant.awq_turbomind.method, imported when vLLM builds the config, and in each worker when it builds the layers (a
worker unpickles the config without running __init__), before anything is compiled.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from .awq_format import BITS
from .support import MIN_CAPABILITY, NAME, OPT_IN_ENV, WAY_OUT, is_awq, opted_in, refusal

if TYPE_CHECKING:
    from vllm.model_executor.layers.linear import LinearMethodBase

logger = logging.getLogger("vllm.turboquant_vllm.awq_turbomind")

class AWQTurboMindConfig(QuantizationConfig):
    """An AutoAWQ GEMM checkpoint's quantization_config (config.json) or quant_config.json, checked against what
    TurboMind runs, on a platform it runs on, with turbomind importable: every refusal at startup."""

    def __init__(self, weight_bits: int = BITS, group_size: int = 128, zero_point: bool = True,
                 modules_to_not_convert: list[str] | None = None, version: str = "gemm",
                 lm_head_quantized: bool = False) -> None:
        super().__init__()
        problem = refusal(weight_bits, group_size, zero_point, version, lm_head_quantized)
        if problem:
            raise ValueError(problem)
        self.weight_bits = weight_bits
        self.group_size = group_size
        self.zero_point = zero_point
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        from . import method  # TurboMind's layers and their torch op, registered before any model is built

        method.check_platform()
        method.load_turbomind()
        logger.info("%s: AWQ int4, group %d, on the GEMM kernels of turbomind %s (fp16; bf16 activations cast at "
                    "each layer)", NAME, group_size, method.turbomind_version())

    def __repr__(self) -> str:
        return (f"AWQTurboMindConfig(weight_bits={self.weight_bits}, group_size={self.group_size}, "
                f"zero_point={self.zero_point}, modules_to_not_convert={self.modules_to_not_convert})")

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return MIN_CAPABILITY

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["quant_config.json", "quantize_config.json"]  # AutoAWQ's own files, as vLLM's AWQ reads them

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQTurboMindConfig:
        method = config.get("quant_method")
        if method is not None and str(method).lower() != "awq":
            raise ValueError(f"{NAME} reads AutoAWQ checkpoints; this one is quantized with {method}: serve it "
                             f"without -q {NAME}.")
        return cls(weight_bits=cls.get_from_keys(config, ["w_bit", "bits"]),
                   group_size=cls.get_from_keys(config, ["q_group_size", "group_size"]),
                   zero_point=cls.get_from_keys(config, ["zero_point"]),
                   modules_to_not_convert=cls.get_from_keys_or(config, ["modules_to_not_convert"], None),
                   version=str(cls.get_from_keys_or(config, ["version"], "gemm")).lower(),
                   lm_head_quantized=bool(cls.get_from_keys_or(config, ["lm_head"], False)))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None,
                                     hf_config: Any = None) -> str | None:
        """An AWQ GEMM checkpoint, claimed only when the user asked for it (-q awq_turbomind: claimed whatever its
        bits / group size, so from_config refuses with the reason) or opted in ($TURBOQUANT_AWQ_TURBOMIND=1 with no
        -q: claimed only where TurboMind runs it). Otherwise None: vLLM's own AWQ method takes it, as without us."""
        explicit = user_quant == NAME
        if not (explicit or (user_quant is None and opted_in())) or not is_awq(hf_quant_cfg):
            return None
        version = str(hf_quant_cfg.get("version", "gemm")).lower()
        problem = refusal(hf_quant_cfg.get("bits", hf_quant_cfg.get("w_bit")),
                          hf_quant_cfg.get("group_size", hf_quant_cfg.get("q_group_size")),
                          hf_quant_cfg.get("zero_point", True), version, bool(hf_quant_cfg.get("lm_head", False)))
        if version != "gemm":
            # not claimed: the AWQ format is not ours to read (vLLM then names the method mismatch)
            logger.warning("%s: not claiming this checkpoint: %s", NAME, problem)
            return None
        if problem and not explicit:
            logger.warning("%s=1, but %s does not run this checkpoint (%s); vLLM's own AWQ kernels serve it",
                           OPT_IN_ENV, NAME, problem)
            return None
        return NAME

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> LinearMethodBase | None:
        from vllm.model_executor.layers.fused_moe import RoutedExperts
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

        from .method import AWQTurboMindLinearMethod

        if isinstance(layer, LinearBase):
            if is_layer_skipped(prefix, self.modules_to_not_convert, self.packed_modules_mapping,
                                match_mode="substring"):
                return UnquantizedLinearMethod()
            return AWQTurboMindLinearMethod(self.group_size, self.weight_bits)
        if isinstance(layer, RoutedExperts):
            raise ValueError(f"{NAME} runs dense linear layers; {prefix} is a mixture-of-experts layer, which "
                             f"TurboMind 0.0.2's GEMM does not run. {WAY_OUT}.")
        return None

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        if self.modules_to_not_convert:
            self.modules_to_not_convert = hf_to_vllm_mapper.apply_list(self.modules_to_not_convert)

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        """As vLLM's AWQ: without modules_to_not_convert, the modules the checkpoint stores in 16 / 32 bits are."""
        if self.modules_to_not_convert:
            return
        from safetensors.torch import _TYPES
        from vllm.transformers_utils import config as hf_utils

        metadata = hf_utils.get_safetensors_params_metadata(model_name, revision=revision)
        layers = {name.rsplit(".", 1)[0] for name in metadata}
        quantized = {name.rsplit(".", 1)[0] for name, info in metadata.items()
                     if (dtype := info.get("dtype")) and _TYPES[dtype] not in (torch.float16, torch.bfloat16,
                                                                               torch.float32)}
        self.modules_to_not_convert = sorted(layers - quantized)


def register() -> None:
    """`-q awq_turbomind` for vLLM: cheap and CUDA-free (turbomind and the layers load when vLLM builds the config)."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    register_quantization_config(NAME)(AWQTurboMindConfig)
