import pytest
import torch

from tests.conftest import DEVICE
from tests.ops.cases import random_calibration
from turboquant_vllm.core.layout import CacheLayout
from turboquant_vllm.core.presets import get_preset
from turboquant_vllm.ops import dequantize_pages, paged_attention, store_kv, warm_up, warmup
from turboquant_vllm.ops.attention import attention as attention_entry
from turboquant_vllm.ops.attention.decode import _decode_kernel
from turboquant_vllm.ops.attention.launch import decode_num_splits, num_sms
from turboquant_vllm.ops.attention.general import _attention_kernel
from turboquant_vllm.ops.dequant.dequant import _dequant_kernel
from turboquant_vllm.ops.rotation.rotation import (
    LARGE_ROWS,
    _merge_and_unrotate_kernel,
    _merge_splits_kernel,
    _spread_rotation_kernel,
)
from turboquant_vllm.ops.store.store import STORE_LARGE_BATCH, _store_kv_kernel


@pytest.mark.matrix(fast=[])  # every prefill launch, interpreted: minutes
@pytest.mark.parametrize("dense_prefill", [True, False])
def test_warm_up_runs_every_prefill_launch(monkeypatch, dense_prefill):
    """The launches serving meets outside CUDA graphs: both store tiles, the context expansion (with the dense
    path), the general attention kernel; each runs for real (interpreted on the CPU)."""
    calls, decodes = [], []

    def record(name, fn):
        def wrapped(*args, **kwargs):
            calls.append((name, kwargs.get("block_t"), kwargs.get("max_query_len"),
                          "query" if kwargs.get("query") is not None else None))
            if name == "paged_attention" and kwargs.get("decode"):
                q_len = kwargs["max_query_len"]
                decodes.append((q_len, args[0].shape[0] // q_len))
            return fn(*args, **kwargs)
        monkeypatch.setattr(warmup, name, wrapped)

    for name, fn in (("store_kv", store_kv), ("dequantize_pages", dequantize_pages),
                     ("paged_attention", paged_attention)):
        record(name, fn)
    if DEVICE == "cpu":
        # Interpreted, as on a GPU of 16 SMs: the split policy fills 132 SMs with ~1,000 decode programs, 16 with 130
        # (2-4 sequences still share one split count, 130-131 another)
        for module in (warmup, attention_entry):
            monkeypatch.setattr(module, "num_sms", lambda device=None: 16)
    layout = CacheLayout(get_preset("tq4"), 64, 1, 16)  # one KV head: half the programs of two
    gen = torch.Generator().manual_seed(0)
    warm_up(layout, torch.bfloat16, 32, torch.device(DEVICE), sliding_window=24, softcap=30.0,
            key_calibration=random_calibration(gen, 1, 64, DEVICE), dense_prefill=dense_prefill,
            decode_batches=[1, 2, 3, 4, 130, 131, 2] if dense_prefill else [2, 1],  # (wide tiles interpret slowly)
            decode_query_len=1 if dense_prefill else 4)
    # both tiles, with the step's queries rotated in the same launch or not (dense or batch-invariant prefills)
    assert {("store_kv", t, None, q) for t in (16, 64) for q in (None, "query")} <= set(calls)
    assert (("dequantize_pages", None, None, None) in calls) == dense_prefill
    query_rows = [c[2] * 32 for c in calls if c[0] == "paged_attention" and c[2] > 4]  # prefills: query = context
    assert min(query_rows) <= LARGE_ROWS < max(query_rows)  # both tilings of the query rotation
    # decodes: one launch per distinct binary: 1 sequence (64 splits, the spread merge), 2 (32 splits, 64 rows,
    # spread; 3 sequences' 96 rows take the same), 130 (4,160 rows: the wide merge tiles; 4 splits, 1 on 16 SMs);
    # verifications of
    # 4 tokens a sequence: 1 and 2 sequences (128 rows: spread; 256: the merge's 16-row tiles)
    assert decodes == ([(1, 1), (1, 2), (1, 130)] if dense_prefill else [(1, 1), (1, 2), (4, 1), (4, 2)])


def compiled(kernel) -> int:
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def serving_launches(layout: CacheLayout, dtype: torch.dtype, q_heads: int, device: torch.device) -> None:
    """Launches as vLLM makes them (keys as views of a fused qkv projection, a block table as wide as max_model_len
    asks, batches of other sizes, a decode batch)."""
    head_dim, kv_heads, block = layout.head_dim, layout.num_kv_heads, layout.block_size
    tokens, width = 2 * STORE_LARGE_BATCH + 5, 45  # the block table of a 720-token max_model_len: not 16-aligned
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    cache = torch.zeros(layout.cache_shape(3 * width), dtype=torch.uint8, device=device)
    block_table = torch.randperm(3 * width, device=device).to(torch.int32).view(3, width)
    slots = (block_table.flatten().long()[:, None] * block + torch.arange(block, device=device)).flatten()[:tokens]
    seq_lens = torch.tensor([500, 77, 9], dtype=torch.int32, device=device)  # rows 0, 1 and 2 (first page) stored
    cu = torch.tensor([0, 500, 577, 586], dtype=torch.int32, device=device)
    store_kv(k, v, cache, slots, layout)  # >= STORE_LARGE_BATCH tokens: the large tiles
    store_kv(k[:40], v[:40], cache, slots[:40], layout)  # a short prefill: the small ones
    # with the step's queries rotated in the same launch, as the backend stores (but for dense prefills)
    rotated = store_kv(k, v, cache, slots, layout, query=q, query_scale=head_dim**-0.5)
    store_kv(k[:40], v[:40], cache, slots[:40], layout, query=q[:40], query_scale=head_dim**-0.5)
    dequantize_pages(cache, layout, block_table, seq_lens, cu, 586, 500, dtype)
    # A mixed batch's prefill rows: metadata slices that start mid-tensor (pointers at any alignment).
    dequantize_pages(cache, layout, block_table[1:], seq_lens[1:], cu[1:] - 500, 86, 77, dtype)
    out = torch.full_like(q[:586], float("nan"))
    paged_attention(q[:586], cache, layout, block_table, cu, seq_lens, max_query_len=500, scale=head_dim**-0.5,
                    out=out)
    paged_attention(q[:86], cache, layout, block_table[1:], cu[1:] - 500, seq_lens[1:], max_query_len=77,
                    scale=head_dim**-0.5, out=out[:86])
    # as the backend runs a mixed batch's prefills: their rows of the store's rotated queries, from row 500 on
    paged_attention(q[500:586], cache, layout, block_table[1:], cu[1:] - 500, seq_lens[1:], max_query_len=77,
                    scale=head_dim**-0.5, out=out[500:586], num_splits=1, rotated_query=rotated.tokens(500, 586))
    splits = decode_num_splits(3, layout, num_sms(device))  # the backend passes its split count explicitly
    decode_out = torch.full_like(q[:3], float("nan"))
    paged_attention(q[:3], cache, layout, block_table, torch.arange(4, dtype=torch.int32, device=device), seq_lens,
                    max_query_len=1, scale=head_dim**-0.5, out=decode_out)  # 3 decodes, the policy's split count
    rotated = store_kv(k[:3], v[:3], cache, slots[:3], layout, query=q[:3], query_scale=head_dim**-0.5)
    paged_attention(q[:3], cache, layout, block_table, torch.arange(4, dtype=torch.int32, device=device), seq_lens,
                    max_query_len=1, scale=head_dim**-0.5, out=decode_out, rotated_query=rotated,
                    num_splits=splits, decode=True)  # as vLLM steps
    # A speculative verification of 3 drafted tokens (4 query slots a sequence, the last sequence drafted 1).
    verify_out = torch.full_like(q[:10], float("nan"))
    rotated = store_kv(k[:10], v[:10], cache, slots[:10], layout, query=q[:10], query_scale=head_dim**-0.5)
    paged_attention(q[:10], cache, layout, block_table, torch.tensor([0, 4, 8, 10], dtype=torch.int32, device=device),
                    seq_lens, max_query_len=4, scale=head_dim**-0.5, out=verify_out, rotated_query=rotated,
                    num_splits=splits, decode=True)
    torch.cuda.synchronize()
    assert not out.isnan().any() and not decode_out.isnan().any() and not verify_out.isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("presets,head_dim,dtype", [
    (("tq4",), 128, torch.bfloat16), (("k4v3",), 64, torch.float16),
    (("tq4", "k4v3", "k5v4"), 128, torch.bfloat16),  # a model with per-layer presets: each preset warmed once
])
def test_serving_shapes_compile_nothing_after_warm_up(presets, head_dim, dtype):
    """After warm_up of each preset's layout, serving-shaped launches of every preset reuse its binaries."""
    kv_heads, q_heads, block = 4, 16, 16
    layouts = [CacheLayout(get_preset(p), head_dim, kv_heads, block) for p in presets]
    device = torch.device("cuda")
    for layout in layouts:
        warm_up(layout, dtype, q_heads, device, decode_batches=range(1, 65), decode_query_len=4)
    kernels = (_store_kv_kernel, _dequant_kernel, _attention_kernel, _decode_kernel, _merge_and_unrotate_kernel,
               _merge_splits_kernel, _spread_rotation_kernel)
    before = [compiled(k) for k in kernels]
    for layout in layouts:
        serving_launches(layout, dtype, q_heads, device)
    assert [compiled(k) for k in kernels] == before, "a serving-shaped launch compiled a new kernel"
