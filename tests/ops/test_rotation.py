import pytest
import torch

from tests.conftest import DEVICE
from tests.ops.cases import random_calibration
from turboquant_vllm.core.layout import CacheLayout
from turboquant_vllm.core.presets import get_preset
from turboquant_vllm.ops import merge_and_unrotate, rotate_queries
from turboquant_vllm.ops.rotation.rotation import SPREAD
from turboquant_vllm.ops.constants import kernel_constants
from turboquant_vllm.ops.rotation.naive import (
    merge_and_unrotate_reference,
    query_offsets_reference,
    rotate_queries_reference,
)

HEAD_DIMS = [64, 96, 128, 256]


def layout_for(head_dim: int, kv_heads: int) -> CacheLayout:
    return CacheLayout(get_preset("tq4"), head_dim, kv_heads, 16)


@pytest.mark.matrix
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("calibrated", [False, True])
def test_rotate_queries_matches_reference(head_dim, dtype, group, calibrated):
    gen = torch.Generator().manual_seed(hash((head_dim, str(dtype), group, calibrated)) % 2**31)
    kv_heads = 2
    tokens = int(torch.randint(1, 40, (1,), generator=gen))
    layout = layout_for(head_dim, kv_heads)
    # A strided view, as vLLM's query is a slice of the fused qkv projection.
    qkv = torch.randn(tokens, kv_heads * group + 3, head_dim, generator=gen).to(dtype).to(DEVICE)
    query = qkv[:, : kv_heads * group]
    cal = random_calibration(gen, kv_heads, head_dim, DEVICE) if calibrated else None
    rotation = kernel_constants(layout, DEVICE).rotation
    for out_dtype in (torch.float16, dtype):
        ours, offset = rotate_queries(query, layout, 0.3, cal, out_dtype)
        assert ours.dtype == out_dtype and ours.is_contiguous() and not ours.isnan().any()
        ref = rotate_queries_reference(query, rotation, 0.3, cal)
        tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3}[out_dtype]  # the output's own rounding
        torch.testing.assert_close(ours.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
        check_offsets(offset, query, 0.3, cal)


@pytest.mark.matrix(fast=["128"])  # two MMA chains of 64 over K
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_spread_rotation_any_chain_length_matches_reference(head_dim):
    """The spread kernel sums independent MMA chains of block_k over K: one chain (block_k = head_dim) or many, the
    rows come out as the reference rotates them, in fp32 output (no rounding to hide behind)."""
    from turboquant_vllm.ops.rotation.rotation import _spread_rotation

    gen = torch.Generator().manual_seed(head_dim)
    layout = layout_for(head_dim, 2)
    rotation = kernel_constants(layout, DEVICE).rotation
    query = torch.randn(3, 10, head_dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    ref = rotate_queries_reference(query, rotation, 0.5, None)
    for block_k in (16, 64, 256):
        out = torch.full(query.shape, float("nan"), dtype=torch.float32, device=DEVICE)
        _spread_rotation(query, out, rotation, query.stride(0), query.stride(1), 0.5, True, block_k)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def check_offsets(offset, query, scale, cal):
    """Under a key calibration, scale * q.mean per (token, query head) in fp32; none without one."""
    if cal is None:
        assert offset is None
        return
    ref = query_offsets_reference(query, scale, cal)
    assert offset.dtype == torch.float32 and offset.shape == query.shape[:2] and offset.is_contiguous()
    torch.testing.assert_close(offset, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.matrix
@pytest.mark.parametrize("spread", [False, True], ids=["one-launch", "spread"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("splits", [1, 2, 6, 8, 12, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_merge_and_unrotate_matches_reference(head_dim, splits, dtype, spread):
    gen = torch.Generator().manual_seed(hash((head_dim, splits, str(dtype), spread)) % 2**31)
    tokens, q_heads = int(torch.randint(1, 20, (1,), generator=gen)), 3
    rows = tokens * q_heads
    layout = layout_for(head_dim, 1)
    acc = torch.randn(rows, splits, head_dim, generator=gen)
    m = torch.randn(rows, splits, generator=gen) * 4
    l_part = torch.rand(rows, splits, generator=gen) * 10 + 0.1
    empty = torch.rand(rows, splits, generator=gen) < 0.3  # splits that saw no key
    empty[0] = True  # a row that saw no key at all
    m[empty], l_part[empty], acc[empty] = float("-inf"), 0.0, 0.0
    ml = torch.stack((m, l_part), dim=1)
    out = torch.full((tokens, q_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    # the spread merge writes over its partials
    merge_and_unrotate(acc.clone().to(DEVICE), ml.to(DEVICE), splits, out, layout, SPREAD if spread else None)
    ref = merge_and_unrotate_reference(acc, ml, kernel_constants(layout, "cpu").rotation)
    assert not out.isnan().any()
    assert (out[0, 0] == 0).all()
    torch.testing.assert_close(out.float().cpu().view(rows, head_dim), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows_per_program", [1, 3, 16])
def test_merge_with_fewer_rows_a_program(rows_per_program):
    """A small batch's merge spread over more programs (rows_per_program < the tile's 16): every row written once,
    the same values as the reference, 64 splits."""
    gen = torch.Generator().manual_seed(rows_per_program)
    tokens, q_heads, head_dim, splits = 2, 9, 128, 64
    rows = tokens * q_heads
    layout = layout_for(head_dim, 1)
    acc = torch.randn(rows, splits, head_dim, generator=gen)
    ml = torch.stack((torch.randn(rows, splits, generator=gen) * 4, torch.rand(rows, splits, generator=gen) + 0.1), 1)
    out = torch.full((tokens, q_heads, head_dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    merge_and_unrotate(acc.to(DEVICE), ml.to(DEVICE), splits, out, layout, rows_per_program=rows_per_program)
    ref = merge_and_unrotate_reference(acc, ml, kernel_constants(layout, "cpu").rotation)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float().cpu().view(rows, head_dim), ref, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match=r"rows_per_program must lie in \[1, 16\]"):
        merge_and_unrotate(acc.to(DEVICE), ml.to(DEVICE), splits, out, layout, rows_per_program=17)


def unrotate(rotated: torch.Tensor, out: torch.Tensor, layout: CacheLayout) -> None:
    """out = rotated @ R through the merge with one split (row maximum 0, sum 1)."""
    rows = rotated.shape[0] * rotated.shape[1]
    ml = torch.stack((torch.zeros(rows, 1), torch.ones(rows, 1)), dim=1).to(rotated.device)
    merge_and_unrotate(rotated.float().reshape(rows, 1, -1).contiguous(), ml, 1, out, layout)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_unrotate_inverts_rotation(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    layout = layout_for(head_dim, 1)
    x = torch.randn(7, 5, head_dim, generator=gen).to(DEVICE)
    rotated = rotate_queries(x, layout, 1.0, dtype=torch.float32).query
    out = torch.full((7, 5, head_dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    # A strided out, as vLLM's output rows can be a slice.
    wide = torch.full((7, 6, head_dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    unrotate(rotated, out, layout)
    unrotate(rotated, wide[:, 1:], layout)
    torch.testing.assert_close(out.float(), x, rtol=1e-2, atol=1e-2)
    assert torch.equal(wide[:, 1:], out) and wide[:, 0].isnan().all()


def test_rejects_bad_input():
    layout = layout_for(64, 1)
    src = torch.randn(4, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        merge_and_unrotate(src, src, 1, torch.empty(2, 64, 4, device=DEVICE).transpose(1, 2), layout)
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        rotate_queries(src.transpose(1, 2), layout, 1.0)


@pytest.mark.matrix(fast=["True"])
@pytest.mark.parametrize("calibrated", [False, True])
def test_prefill_sized_inputs_match_reference(calibrated):
    """Over 4096 rows the kernels take wider tiles (kernels.rotation.launch_shape)."""
    gen = torch.Generator().manual_seed(11)
    layout = layout_for(128, 2)
    query = torch.randn(531, 8, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    cal = random_calibration(gen, 2, 128, DEVICE) if calibrated else None
    rotation = kernel_constants(layout, DEVICE).rotation
    ours, offset = rotate_queries(query, layout, 0.5, cal, torch.float32)
    ref = rotate_queries_reference(query, rotation, 0.5, cal)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    check_offsets(offset, query, 0.5, cal)
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)
    unrotate(ours, out, layout)
    expected = (ref @ rotation).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
