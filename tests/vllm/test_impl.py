"""The impl end to end on one mixed step (runs the Triton kernels; on a CPU through TRITON_INTERPRET):
store the new keys/values through do_kv_cache_update, attend through forward with the builder's
metadata, and compare with the pure-PyTorch reference over the same compressed pages."""

from __future__ import annotations

import pytest
import torch

from tests.vllm.conftest import make_builder, make_cam, make_layers
from turboquant_vllm.core.reference import paged_attention_reference
from turboquant_vllm.vllm.backend import TQ4AttentionBackend, layout_of_cache

BLOCK = 16
Q_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64


@pytest.mark.parametrize(
    "layer_kwargs",
    [{}, {"per_layer_sliding_window": 8, "logits_soft_cap": 30.0}],
    ids=["plain", "window+softcap"],
)
@pytest.mark.parametrize("preset", ["tq4", "k3v2"])
def test_mixed_step_matches_reference(vllm_config, workspace, bf16_default, monkeypatch, preset, layer_kwargs):
    monkeypatch.setenv("TURBOQUANT_PRESET", preset)
    gen = torch.Generator().manual_seed(0)
    (layer,) = make_layers(vllm_config, 1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                           **layer_kwargs)
    impl = layer.impl
    builder = make_builder(vllm_config, [layer.layer_name], kv_heads=KV_HEADS, head_size=HEAD_DIM)

    # decode, decode, chunked-prefill continuation, fresh prefill
    cached = [37, 4, 20, 0]
    q_lens = [1, 1, 9, 12]
    seq_lens = [c + q for c, q in zip(cached, q_lens)]
    blocks_per_seq = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5
    kv_cache = torch.zeros(TQ4AttentionBackend.get_kv_cache_shape(num_blocks, BLOCK, KV_HEADS, HEAD_DIM),
                           dtype=torch.uint8)
    perm = torch.randperm(num_blocks, generator=gen)[: sum(blocks_per_seq)].to(torch.int32)
    block_table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        block_table[i, :n] = perm[start : start + n]
        start += n

    def slots(seq, positions):
        return torch.tensor([int(block_table[seq, p // BLOCK]) * BLOCK + p % BLOCK for p in positions],
                            dtype=torch.int64)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    # earlier steps filled the cached tokens
    ctx_slots = torch.cat([slots(i, range(c)) for i, c in enumerate(cached)])
    n_ctx = ctx_slots.shape[0]
    impl.do_kv_cache_update(layer, rand(n_ctx, KV_HEADS, HEAD_DIM), rand(n_ctx, KV_HEADS, HEAD_DIM), kv_cache,
                            ctx_slots)

    # this step: 23 real tokens, padded to 24 as a CUDA-graph size would; slot_mapping is not padded
    n_real, n_padded = sum(q_lens), 24
    step_slots = torch.cat([slots(i, range(c, s)) for i, (c, s) in enumerate(zip(cached, seq_lens))])
    query = rand(n_padded, Q_HEADS, HEAD_DIM)
    key, value = rand(n_padded, KV_HEADS, HEAD_DIM), rand(n_padded, KV_HEADS, HEAD_DIM)
    impl.do_kv_cache_update(layer, key, value, kv_cache, step_slots)

    cam = make_cam(q_lens, seq_lens, num_actual_tokens=n_padded, block_table=block_table, slot_mapping=step_slots)
    md = builder.build(0, cam)
    assert (md.num_decodes, md.num_prefills) == (2, 2) and md.decode_num_splits > 1
    output = torch.full((n_padded, Q_HEADS, HEAD_DIM), float("nan"), dtype=torch.bfloat16)
    impl.forward(layer, query, key, value, kv_cache, md, output=output)

    layout = layout_of_cache(impl.preset, HEAD_DIM, kv_cache)
    expected = paged_attention_reference(
        query[:n_real], kv_cache, layout, block_table, cam.query_start_loc, cam.seq_lens, impl.scale,
        sliding_window=impl.sliding_window, softcap=impl.softcap,
    )
    torch.testing.assert_close(output[:n_real].float(), expected, atol=2e-2, rtol=2e-2)


def test_profiling_run_without_metadata_zeroes_the_output(vllm_config, bf16_default):
    (layer,) = make_layers(vllm_config, 1)
    out = torch.ones(3, 32, 128, dtype=torch.bfloat16)
    q = torch.zeros(3, 32, 128, dtype=torch.bfloat16)
    layer.impl.forward(layer, q, None, None, torch.empty(0), None, output=out)
    assert not out.any()
    # before the cache is bound, storing is a no-op
    layer.impl.do_kv_cache_update(layer, q[:, :8], q[:, :8], torch.empty(0), torch.zeros(3, dtype=torch.int64))
