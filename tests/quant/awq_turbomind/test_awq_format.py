"""AutoAWQ's GEMM format in plain PyTorch (quant.awq_turbomind.awq_format) against vLLM's own AWQ kernels."""

import pytest
import torch

from turboquant_vllm.quant.awq_turbomind import awq_format as awq


@pytest.mark.parametrize("rows, n", [(1, 8), (7, 24), (130, 64)])
def test_pack_then_unpack_is_exact(rows, n):
    gen = torch.Generator().manual_seed(rows * n)
    codes = torch.randint(0, 16, (rows, n), generator=gen, dtype=torch.int32)
    codes[0, :8] = 15  # the top code of column 7 lands on the sign bit
    words = awq.pack(codes)
    assert words.dtype == torch.int32 and words.shape == (rows, n // 8)
    assert torch.equal(awq.unpack(words), codes)


def test_pack_order_is_awqs():
    """Column 8j + PACK_ORDER[i] at bits 4i: columns 0..7 holding codes 0..7 give the word 0x75316420."""
    assert awq.pack(torch.arange(8, dtype=torch.int32)[None, :]).item() == 0x75316420


@pytest.mark.parametrize("k, n", [(1, 8), (33, 40), (128, 64)])
def test_pack_matches_vllms_awq_packer(k, n):
    """vLLM's own AWQ packer (quant_utils.awq_pack, what its AWQ kernel tests build checkpoints with) packs as we do."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import awq_pack

    codes = torch.randint(0, 16, (k, n), generator=torch.Generator().manual_seed(k + n), dtype=torch.int32)
    assert torch.equal(awq.pack(codes), awq_pack(codes, 4, k, n))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's Triton kernels need a GPU (vLLM disables Triton "
                    "without an active driver)")
@pytest.mark.parametrize("k, n, group_size", [(128, 64, 32), (256, 40, 128), (192, 16, 64)])
def test_dequantize_matches_vllms_awq_kernel(k, n, group_size):
    """vLLM's Triton AWQ dequantizer (the `awq` method's fallback kernel) decodes our packing to the same weight."""
    from vllm.model_executor.layers.quantization.awq_triton import awq_dequantize_triton

    gen = torch.Generator().manual_seed(k + n)
    w = awq.AWQWeight(awq.pack(torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)),
                      awq.pack(torch.randint(0, 16, (k // group_size, n), generator=gen, dtype=torch.int32)),
                      (torch.rand(k // group_size, n, generator=gen) * 0.02 + 1e-3).half())
    theirs = awq_dequantize_triton(w.qweight.cuda(), w.scales.cuda(), w.qzeros.cuda()).cpu()
    assert torch.equal(awq.dequantize(w).half(), theirs)  # integer difference times an fp16 scale: one rounding


@pytest.mark.parametrize("group_size", [32, 128])
def test_quantize_rounds_to_the_stored_scale(group_size):
    gen = torch.Generator().manual_seed(group_size)
    weight = torch.randn(256, 48, generator=gen) * torch.rand(1, 48, generator=gen) * 0.1
    weight[3, 5] = 0.9  # an outlier widens its group's step only
    w = awq.quantize(weight, group_size)
    assert w.group_size == group_size and w.scales.dtype == torch.float16
    step = w.scales.float().repeat_interleave(group_size, dim=0)
    err = (awq.dequantize(w) - weight).abs()
    assert (err <= step * 1.0001).all()  # half a step of rounding, half a step of the zero point's
    assert err.mean() < 0.3 * step.mean()
    codes = awq.unpack(w.qweight)
    assert codes.min() == 0 and codes.max() == 15  # each group spans the whole code range


def test_bad_input_names_the_constraint():
    with pytest.raises(ValueError, match="multiple of 8"):
        awq.pack(torch.zeros(2, 12, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        awq.pack(torch.full((1, 8), 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        awq.unpack(torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="multiple of the group size 128"):
        awq.quantize(torch.zeros(100, 8), 128)
    w = awq.quantize(torch.randn(64, 16), 32)
    with pytest.raises(ValueError, match="disagree"):
        awq.dequantize(awq.AWQWeight(w.qweight, w.qzeros[:1], w.scales))
