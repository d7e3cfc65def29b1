"""quartet2 layers built and loaded as vLLM does it, for the tests: a bf16 weight quantized after loading, or a
CloverLM fused layer read from its NVFP4 parts (codes, blocked E4M3 scales, a tensor scale each)."""

from __future__ import annotations

import torch


def on_the_fly_layer(quant, w: torch.Tensor, parts: list[int], dtype: torch.dtype) -> torch.nn.Module:
    """w (N, K) loaded through vLLM's default loader into a layer of output parts `parts`, then quantized."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    n, k = w.shape
    layer = torch.nn.Module()
    with torch.device(w.device):
        quant.create_weights(layer, k, list(parts), k, n, dtype, weight_loader=default_weight_loader)
    layer.weight.weight_loader(layer.weight, w)
    quant.process_weights_after_loading(layer)
    return layer


def nvfp4_fused_layer(quant, stored: list, codes=lambda packed: packed) -> torch.nn.Module:
    """A fused bf16 layer of len(stored) equal parts, each loaded from its NVFP4Weight as a checkpoint stores it
    (codes(packed) as the codes tensor), then prepared."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    from turboquant_vllm.quant.quartet2.nvfp4 import blocked

    rows, k = stored[0].packed.shape[0], stored[0].packed.shape[1] * 2
    layer = torch.nn.Module()
    with torch.device(stored[0].packed.device):
        quant.create_weights(layer, k, [rows] * len(stored), k, rows * len(stored), torch.bfloat16,
                             weight_loader=default_weight_loader)
    for i, q in enumerate(stored):
        layer.weight.load_merged_column_weight(codes(q.packed), shard_offset=rows * i, shard_size=rows)
        layer.weight_scale.load_merged_column_weight(blocked.block_scales(q.scales), shard_offset=rows * i,
                                                     shard_size=rows)
        layer.weight_scale_2.load_merged_column_weight(q.tensor_scale.reshape(1), shard_id=i)
    quant.process_weights_after_loading(layer)
    return layer
