import pytest
import torch

from tests.conftest import DEVICE
from tests.ops.cases import keys_with_sinks, make_paged_batch, random_calibration
from turboquant_vllm.core.presets import PRESETS
from turboquant_vllm.core.quantizer import Quantizer
from turboquant_vllm.ops import store_kv
from turboquant_vllm.ops.constants import kernel_constants
from turboquant_vllm.ops.rotation.naive import query_offsets_reference, rotate_queries_reference
from turboquant_vllm.ops.store.naive import store_kv_reference
from turboquant_vllm.ops.store.store import STORE_LARGE_BATCH, store_block_tokens

HEAD_DIMS = [64, 96, 128, 256]


def near_boundary_bytes(x, layout, bits, eps=1e-5):
    """Codes whose rotated coordinate sits within fp32 rounding of a decision boundary may differ."""
    q = Quantizer(bits, layout.head_dim)
    xf = x.float().cpu()
    y = (xf @ q.rotation().T) / torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
    edges = torch.cat([q.boundaries(), torch.zeros(1)])
    return ((y.abs().unsqueeze(-1) - edges).abs() < eps).any(-1)


@pytest.mark.matrix
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("calibrated", [False, True])
def test_store_matches_reference(preset, head_dim, dtype, calibrated):
    gen = torch.Generator().manual_seed(hash((preset, head_dim, str(dtype), calibrated)) % 2**31)
    block_size = [16, 32][head_dim % 3 == 0]
    batch = make_paged_batch(gen, preset, head_dim, 2, block_size, [37, 5], dtype, DEVICE)
    cal = random_calibration(gen, 2, head_dim, DEVICE) if calibrated else None
    if cal is not None:  # each sequence's first token a sink, stored uncentered (negative norm)
        batch.keys = keys_with_sinks(gen, batch.keys, cal, [0, 37])
    slots = batch.slot_mapping.clone()
    slots[3] = -1  # skipped token: its slot keeps the poison
    ours, ref = batch.kv_cache.clone(), batch.kv_cache.clone()
    # The prefill-sized tile (store_block_tokens) on half the cases: 42 tokens leave it mostly masked.
    large = store_block_tokens(STORE_LARGE_BATCH, head_dim)
    store_kv(batch.keys, batch.values, ours, slots, batch.layout, cal, block_t=large if calibrated else None)
    store_kv_reference(batch.keys, batch.values, ref, slots, batch.layout, cal)
    lay = batch.layout
    codes = torch.ones(lay.head_page_bytes, dtype=torch.bool, device=ours.device)
    codes[lay.key_norm_offset : lay.value_code_offset] = False
    codes[lay.value_norm_offset :] = False
    diff = (ours != ref)[:, :, codes]
    if diff.any():
        # A differing code must belong to a coordinate within fp32 rounding of a decision boundary.
        keys = batch.keys if cal is None else cal.choose_keys(batch.keys)[0]
        loose = near_boundary_bytes(keys, lay, lay.preset.k_bits).any() or near_boundary_bytes(
            batch.values, lay, lay.preset.v_bits
        ).any()
        assert loose, f"{int(diff.sum())} code bytes differ with no coordinate near a boundary"
        assert diff.sum() <= 2
    # Norms agree to fp32 rounding where the record's codes agree (norm correction depends on them).
    live = slots[slots >= 0]
    blk, o = live // lay.block_size, live % lay.block_size

    def records(cache, off, size):
        raw = cache.view(cache.shape[0], lay.num_kv_heads, -1)[:, :, off : off + size * lay.block_size]
        return raw.contiguous().view(cache.shape[0], lay.num_kv_heads, lay.block_size, size)[blk, :, o]

    for code_off, code_bytes, norm_off in ((0, lay.key_code_bytes, lay.key_norm_offset),
                                           (lay.value_code_offset, lay.value_code_bytes, lay.value_norm_offset)):
        same = (records(ours, code_off, code_bytes) == records(ref, code_off, code_bytes)).all(-1)
        assert same.float().mean() > 0.9
        n_ours, n_ref = (records(c, norm_off, 4).contiguous().view(torch.float32)[..., 0] for c in (ours, ref))
        torch.testing.assert_close(n_ours[same], n_ref[same], rtol=2e-6, atol=0)
        if code_off == 0 and cal is not None:  # uncentered exactly where choose_keys says, the sinks among them
            centered = cal.choose_keys(batch.keys)[1][slots >= 0]
            assert torch.equal(n_ours < 0, ~centered) and centered.any()
            assert (n_ours[[0, 36]] < 0).all()  # the sinks (token 37 is live row 36: token 3 is skipped)
        else:
            assert (n_ours >= 0).all()


@pytest.mark.matrix
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("calibrated", [False, True])
def test_store_rotates_the_decode_queries_in_the_same_launch(head_dim, dtype, group, calibrated):
    gen = torch.Generator().manual_seed(hash((head_dim, str(dtype), group, calibrated, "q")) % 2**31)
    kv_heads, tokens = 2, int(torch.randint(17, 40, (1,), generator=gen))
    queries = int(torch.randint(1, tokens + 1, (1,), generator=gen))  # the decode tokens come first
    batch = make_paged_batch(gen, "tq4", head_dim, kv_heads, 16, [tokens], dtype, DEVICE)
    cal = random_calibration(gen, kv_heads, head_dim, DEVICE) if calibrated else None
    # A strided view, as vLLM's query is a slice of the fused qkv projection.
    qkv = torch.randn(tokens, kv_heads * group + 3, head_dim, generator=gen).to(dtype).to(DEVICE)
    query = qkv[:queries, : kv_heads * group]
    plain, fused = batch.kv_cache.clone(), batch.kv_cache.clone()
    assert store_kv(batch.keys, batch.values, plain, batch.slot_mapping, batch.layout, cal) is None
    ours = store_kv(batch.keys, batch.values, fused, batch.slot_mapping, batch.layout, cal, query=query,
                    query_scale=0.3)
    assert torch.equal(plain, fused)  # the cache is written as without the queries
    rotated, offset = ours
    assert rotated.dtype == torch.float16 and rotated.shape == query.shape and not rotated.isnan().any()
    ref = rotate_queries_reference(query, kernel_constants(batch.layout, DEVICE).rotation, 0.3, cal)
    torch.testing.assert_close(rotated.float(), ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())  # fp16 rounding
    if cal is None:
        assert offset is None
    else:
        ref = query_offsets_reference(query, 0.3, cal)
        assert offset.shape == query.shape[:2] and offset.dtype == torch.float32
        torch.testing.assert_close(offset, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    with pytest.raises(ValueError, match="query must be"):
        store_kv(batch.keys, batch.values, fused, batch.slot_mapping, batch.layout, query=qkv[:, :3])


def test_store_tiles_grow_with_the_batch():
    sizes = (1, 64, STORE_LARGE_BATCH - 1, STORE_LARGE_BATCH, 16384)
    for head_dim, large in ((64, 64), (128, 64), (256, 32)):  # d 256: 64 tokens spill (store_block_tokens)
        assert [store_block_tokens(n, head_dim) for n in sizes] == [16] * 3 + [large] * 2


def test_store_rejects_bad_input():
    gen = torch.Generator().manual_seed(0)
    b = make_paged_batch(gen, "tq4", 64, 2, 16, [4], torch.float16, DEVICE)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        store_kv(b.keys.float(), b.values.float(), b.kv_cache, b.slot_mapping, b.layout)
    with pytest.raises(ValueError, match="shape"):
        store_kv(b.keys[:, :1], b.values[:, :1], b.kv_cache, b.slot_mapping, b.layout)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        store_kv(b.keys, b.values, b.kv_cache, b.slot_mapping.float(), b.layout)
    with pytest.raises(ValueError, match="kv_cache must be uint8"):
        store_kv(b.keys, b.values, b.kv_cache[:, :, :-1], b.slot_mapping, b.layout)
