"""The `quartet2` quantization method's linear layers for vLLM (its config and registration: plugin.config; the path
choice: plugin.paths): weights created and loaded as vLLM loads them, quantized to NVFP4 (or read from a CloverLM
NVFP4 checkpoint), and run on the path the config chose. Imported when vLLM builds a layer with the config.
"""

from __future__ import annotations

import logging

import torch
from vllm.model_executor.layers.linear import LinearMethodBase, register_weight_loader_v2_supported_method
from vllm.model_executor.parameter import ModelWeightParameter, PerTensorScaleParameter
from vllm.model_executor.utils import set_weight_attrs

from .. import nvfp4
from ..kernels import marlin, marlin_mma, w4a4
from ..kernels.emulate import emulated_linear
from ..kernels.marlin_mma import native
from ..kernels.quantize import quantize_parts
from ..nvfp4 import NVFP4Weight, blocked

logger = logging.getLogger("vllm.turboquant_vllm.quartet2")  # the config's logger


def _return_free_segments(device: torch.device) -> None:
    """vLLM loads weights with the allocator's max_split_size_mb at 20: a block of 20 MiB or more is never split, so a
    layer's lasting tensor placed in a larger free block (left by the bf16 weight or the quantizer's buffers) keeps
    all of it (0.35 GiB on the CloverLM-4B shape). With the free segments returned first it gets one of its size."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _keep(layer: torch.nn.Module, **tensors: torch.Tensor | None) -> None:
    """The prepared weight as frozen parameters, as vLLM's own quantized layers keep theirs (vLLM's AOT-compiled
    forward found module buffers registered after loading missing: KeyError at the first step); None stays None."""
    for name, t in tensors.items():
        setattr(layer, name, None if t is None else torch.nn.Parameter(t, requires_grad=False))


# vLLM's parameter-aware loaders: the NVFP4 checkpoint's per-part tensor scales (_scale_2) land in their slots of a
# fused layer only through them (the legacy loader asserts on a scalar for a fused layer)
@register_weight_loader_v2_supported_method
class Quartet2LinearMethod(LinearMethodBase):
    """bf16 weights loaded as vLLM loads them (sharded, fused), then NVFP4: 0.28x their bytes. From a CloverLM NVFP4
    checkpoint: codes, blocked scales and one tensor scale per fused part, loaded as they are and unblocked once.
    Then kept as they are (emulate), or put once into the layout of Marlin (marlin) or of the FP4 GEMM (w4a4)."""

    _dense_logged = False  # the decoded-weight GEMM's log line, once per process

    def __init__(self, path: str, prequantized: bool = False) -> None:
        self.path = path  # plugin.paths.choose_path's: w4a4, marlin or emulate
        self.prequantized = prequantized  # a CloverLM NVFP4 checkpoint's tensors, not a bf16 weight

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        if input_size_per_partition % nvfp4.GROUP:
            raise ValueError(f"quartet2: NVFP4 scales groups of {nvfp4.GROUP} input features; this layer has "
                             f"{input_size_per_partition} per tensor-parallel rank. Use a tensor-parallel size "
                             f"that keeps it a multiple of {nvfp4.GROUP}, or serve without -q quartet2")
        weight_loader = extra_weight_attrs.pop("weight_loader")
        layer.quartet2_dtype = params_dtype  # the activations' dtype: Marlin's scales are prepared for it
        layer.quartet2_parts = list(output_partition_sizes)  # a fused layer's parts: a tensor scale each
        if self.prequantized:
            self._create_nvfp4_weights(layer, input_size_per_partition, input_size, output_partition_sizes,
                                       weight_loader, extra_weight_attrs)
            return
        weight = ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            input_dim=1, output_dim=0, weight_loader=weight_loader)
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)

    def _create_nvfp4_weights(self, layer: torch.nn.Module, input_size_per_partition: int, input_size: int,
                              output_partition_sizes: list[int], weight_loader, extra_weight_attrs: dict) -> None:
        # The blocked scales shard by whole 128-row tiles along the outputs, never along the inputs.
        if input_size_per_partition != input_size:
            raise ValueError("quartet2: CloverLM NVFP4 checkpoints' blocked scales cannot be split along the input "
                             "features (a row-parallel layer under tensor parallelism): serve with "
                             "--tensor-parallel-size 1, or quantize the bf16 checkpoint on the fly (-q quartet2)")
        if any(n % blocked.TILE_ROWS for n in output_partition_sizes) or input_size % 64:
            raise ValueError(f"quartet2: CloverLM NVFP4 checkpoints hold whole 128 x 64 scale tiles; this layer's "
                             f"parts {output_partition_sizes} x {input_size} are not (quantize the bf16 checkpoint "
                             f"on the fly, -q quartet2)")
        rows = sum(output_partition_sizes)

        def load_codes(param, loaded: torch.Tensor, *args, **kwargs):  # the converter's dtype, copied as bytes
            return weight_loader(param, loaded.view(torch.uint8), *args, **kwargs)

        params = {
            "weight": ModelWeightParameter(data=torch.empty(rows, input_size // 2, dtype=torch.uint8), input_dim=1,
                                           output_dim=0, weight_loader=load_codes),
            "weight_scale": ModelWeightParameter(
                data=torch.empty(rows, input_size // nvfp4.GROUP, dtype=torch.float8_e4m3fn), input_dim=1,
                output_dim=0, weight_loader=weight_loader),
            "weight_scale_2": PerTensorScaleParameter(
                data=torch.empty(len(output_partition_sizes), dtype=torch.float32), weight_loader=weight_loader),
        }
        for name, param in params.items():
            layer.register_parameter(name, param)
            set_weight_attrs(param, extra_weight_attrs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        device = layer.weight.device
        _return_free_segments(device)
        if self.prequantized:
            # one tensor scale per fused part, spread over its output rows (the epilogue's per-column scale)
            parts = torch.tensor(layer.quartet2_parts, device=layer.weight_scale_2.device)
            row_scale = layer.weight_scale_2.data.repeat_interleave(parts)
            w = NVFP4Weight(layer.weight.data, blocked.unblock_scales(layer.weight_scale.data), row_scale)
            del layer.weight, layer.weight_scale, layer.weight_scale_2
        else:
            w = quantize_parts(layer.weight.data, layer.quartet2_parts)  # q / k / v, gate / up: a scale each
            del layer.weight  # the bf16 copy goes: only the NVFP4 weight stays
        _return_free_segments(device)  # before the path's own copies (Marlin's repack) are made
        if self.path == "marlin":
            self._prepare_marlin(layer, w)
            return
        if self.path == "w4a4":
            p = w4a4.prepare(w)
            _keep(layer, w4a4_weight=p.weight, w4a4_weight_scale=p.weight_scale, w4a4_alpha=p.alpha,
                  w4a4_channel_scale=p.channel_scale)
            layer.quartet2_w4a4_shape = (p.size_n, p.size_k)
            return
        _keep(layer, weight_packed=w.packed, weight_scales=w.scales, weight_tensor_scale=w.tensor_scale)

    @staticmethod
    def _prepare_marlin(layer: torch.nn.Module, w: NVFP4Weight) -> None:
        dtype = getattr(layer, "quartet2_dtype", torch.bfloat16)
        flushed = int(marlin.marlin_flushed_groups(w.scales, dtype).sum())
        if flushed:
            logger.warning("quartet2: %d of %d NVFP4 groups of 16 weights have block scales below Marlin's range "
                           "(E4M3 subnormals) and run as zeros (by the 4/6 rule, groups whose largest weight is "
                           "below 6.2e-5 of the tensor's)", flushed, w.scales.numel())
        m = marlin.prepare(w, dtype)
        if not Quartet2LinearMethod._dense_logged:
            Quartet2LinearMethod._dense_logged = True
            if m.dense_min_tokens:
                logger.info("quartet2: GEMMs of %d tokens and more decode the weight for cuBLAS (one buffer of the "
                            "largest layer's size; %s=0 keeps Marlin for all)", m.dense_min_tokens, marlin.DENSE_ENV)
            if m.mma_max_tokens:
                logger.info("quartet2: GEMMs of 1-%d tokens run the native few-token kernel (%s; %s=0 keeps Marlin)",
                            m.mma_max_tokens, native.library_path(), marlin.MMA_ENV)
            else:
                why = (f"off ({marlin.MMA_ENV}=0)" if not marlin.mma_enabled()
                       else marlin_mma.supported(w.packed.device))
                logger.info("quartet2: GEMMs of few tokens run Marlin: the native few-token kernel is %s", why)
        _keep(layer, marlin_weight=m.weight, marlin_weight_scale=m.weight_scale,
              marlin_global_scale=m.weight_global_scale, marlin_channel_scale=m.channel_scale)
        layer.quartet2_marlin_shape = (m.size_n, m.size_k)
        layer.quartet2_marlin_dense = (m.dense_alpha, m.dense_min_tokens, m.mma_max_tokens)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.path == "marlin":
            m = marlin.MarlinNVFP4(layer.marlin_weight, layer.marlin_weight_scale, layer.marlin_global_scale,
                                   layer.marlin_channel_scale, *layer.quartet2_marlin_shape,
                                   layer.quartet2_dtype, *layer.quartet2_marlin_dense)
            return marlin.marlin_linear(x, m, bias)
        if self.path == "w4a4":
            p = w4a4.W4A4Weight(layer.w4a4_weight, layer.w4a4_weight_scale, layer.w4a4_alpha,
                                layer.w4a4_channel_scale, *layer.quartet2_w4a4_shape)
            return w4a4.w4a4_linear(x, p, bias)
        weight = NVFP4Weight(layer.weight_packed, layer.weight_scales, layer.weight_tensor_scale)
        return emulated_linear(x, weight, bias)
