"""Marlin's layout on the CPU for the marlin kernels' tests: vLLM's own prepare_fp4_layer_for_marlin, its one CUDA
op (gptq_marlin_repack) replaced by vLLM's plain-PyTorch reference of it."""

import pytest
import torch

from turboquant_vllm.quant.quartet2.kernels import marlin_layout


def reference_repack(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False):
    """gptq_marlin_repack by vLLM's Python reference (marlin_utils_test.marlin_weights)."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import get_weight_perm, marlin_weights

    assert num_bits == 4 and not is_a_8bit
    codes = marlin_layout.unpack_words(b_q_weight.cpu()).permute(0, 2, 1).reshape(size_k, size_n)
    return marlin_weights(codes.to(torch.int32), size_k, size_n, 4, get_weight_perm(4)).to(b_q_weight.device)


@pytest.fixture
def marlin_layout_on_cpu(monkeypatch):
    from vllm import _custom_ops as ops

    monkeypatch.setattr(ops, "gptq_marlin_repack", reference_repack, raising=False)
    marlin_layout.tables.cache_clear()
    yield
    marlin_layout.tables.cache_clear()
