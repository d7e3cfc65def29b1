"""Metadata builder: decode, prefill, chunked prefill and mixed batches; CUDA-graph-safe tensors."""

from __future__ import annotations

import pytest
import torch

from tests.vllm.conftest import make_builder, make_cam, make_layers
from turboquant_vllm.core.presets import get_preset
from turboquant_vllm.ops.attention import decode_launch, split_count

TQ4_PER_SM = decode_launch(get_preset("tq4"), 128).programs_per_sm  # the builder's layers: tq4, head_dim 128


@pytest.fixture
def builder(vllm_config, bf16_default):
    make_layers(vllm_config, 2)
    return make_builder(vllm_config, ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"])


def test_builder_setup(builder):
    assert builder.num_q_heads == 32 and builder.layout.num_kv_heads == 8 and builder.layout.head_dim == 128
    assert builder.reorder_batch_threshold == 1  # vLLM orders decodes first


def test_decode_batch_uses_persistent_tensors(builder):
    cam = make_cam([1, 1, 1], [17, 300, 5])
    md = builder.build(0, cam)
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills, md.num_prefill_tokens) == (3, 3, 0, 0)
    assert md.decode_num_splits == split_count(3, 8, builder.num_sms, TQ4_PER_SM)
    # a captured graph must see the runner's persistent buffers, not copies
    assert md.decode_query_start_loc is cam.query_start_loc
    assert md.decode_seq_lens is cam.seq_lens and md.decode_block_table is cam.block_table_tensor
    assert md.prefill_query_start_loc is None


def test_padded_decode_batch_counts_real_tokens(builder):
    # a CUDA-graph-sized batch: 3 real decodes, padded to 4 tokens / 4 requests (the last empty)
    cam = make_cam([1, 1, 1, 0], [17, 300, 5, 0], num_actual_tokens=4)
    md = builder.build(0, cam)
    assert (md.num_decodes, md.num_decode_tokens) == (4, 3)
    assert md.num_actual_tokens == 4


def test_prefill_batch(builder):
    cam = make_cam([5, 9], [5, 9])
    md = builder.build(0, cam)
    assert (md.num_decodes, md.num_prefills, md.num_prefill_tokens) == (0, 2, 14)
    assert md.prefill_query_start_loc is cam.query_start_loc
    assert md.prefill_max_query_len == 9


def test_chunked_prefill_batch(builder):
    # continuation chunks: 8 new tokens on top of 40 cached, 3 on top of 100
    cam = make_cam([8, 3], [48, 103])
    md = builder.build(0, cam)
    assert (md.num_decodes, md.num_prefills, md.num_prefill_tokens) == (0, 2, 11)
    assert md.prefill_seq_lens.tolist() == [48, 103]


def test_mixed_batch_splits_decodes_from_the_rest(builder):
    cam = make_cam([1, 1, 7, 3], [40, 3, 7, 23])
    md = builder.build(0, cam)
    assert (md.num_decodes, md.num_decode_tokens) == (2, 2)
    assert (md.num_prefills, md.num_prefill_tokens) == (2, 10)
    assert md.decode_query_start_loc.tolist() == [0, 1, 2]
    assert md.decode_seq_lens.tolist() == [40, 3]
    assert md.prefill_query_start_loc.tolist() == [0, 7, 10]  # rebased to the prefill tokens
    assert md.prefill_seq_lens.tolist() == [7, 23]
    assert md.prefill_block_table.shape[0] == 2
    assert md.decode_num_splits == split_count(2, 8, builder.num_sms, TQ4_PER_SM)


def test_short_queries_are_prefills_without_speculation(builder):
    cam = make_cam([3, 3, 3], [50, 60, 70])
    md = builder.build(0, cam)
    assert (md.num_decodes, md.num_prefills, md.num_prefill_tokens) == (0, 3, 9)
    assert md.prefill_query_start_loc is cam.query_start_loc


def test_unordered_batch_is_still_correctly_covered(builder):
    cam = make_cam([4, 1, 1], [10, 20, 30])  # a decode after a prefill: all go to the general kernel
    md = builder.build(0, cam)
    assert (md.num_decodes, md.num_prefills, md.num_prefill_tokens) == (0, 3, 6)


def test_builds_for_capture_and_drafting(builder):
    cam = make_cam([1] * 8, [1] * 8)
    assert builder.build_for_cudagraph_capture(cam).num_decodes == 8
    assert builder.build_for_drafting(cam, draft_index=0).num_decodes == 8


def test_builder_refuses_an_uncompressed_spec(vllm_config, bf16_default):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from turboquant_vllm.vllm.metadata import TurboQuantMetadataBuilder

    make_layers(vllm_config, 1)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not a TurboQuant spec"):
        TurboQuantMetadataBuilder(spec, ["model.layers.0.self_attn.attn"], vllm_config, torch.device("cpu"))


def test_long_prefills_take_the_dense_path(builder, monkeypatch):
    from turboquant_vllm.vllm.metadata import DENSE_PREFILL_MIN_TOKENS

    builder.dense_prefill = True  # as on a GPU where FlashAttention imports
    n = DENSE_PREFILL_MIN_TOKENS
    md = builder.build(0, make_cam([1, n, 40], [30, n, 140]))
    assert md.prefill_cu_seqlens_k.tolist() == [0, n, n + 140]
    assert (md.prefill_total_k, md.prefill_max_seq_len) == (n + 140, 140 if n < 140 else n)
    short = builder.build(0, make_cam([1, 5], [30, 5]))  # few prefill tokens: the paged kernel
    assert short.prefill_cu_seqlens_k is None


@pytest.fixture
def speculative_builder(vllm_config, bf16_default):
    """A builder under speculative decoding of 3 drafted tokens."""
    from vllm.config import SpeculativeConfig

    make_layers(vllm_config, 1)
    vllm_config.speculative_config = SpeculativeConfig.__new__(SpeculativeConfig)  # only these two are read
    vllm_config.speculative_config.num_speculative_tokens = 3
    vllm_config.speculative_config.parallel_drafting = False
    builder = make_builder(vllm_config, ["model.layers.0.self_attn.attn"])
    builder.dense_prefill = True  # as on a GPU where FlashAttention imports
    return builder


def test_verifications_run_as_decodes(speculative_builder):
    """Verifications of up to 1 + 3 tokens are decodes (vLLM orders them first): a uniform batch uses the persistent
    buffers whole (vLLM captures it), at the split count of as many decoding sequences, in 4 query slots a sequence;
    a batch of single tokens keeps one slot."""
    builder = speculative_builder
    assert builder.reorder_batch_threshold == 4 and builder.capturable_query_len == 4
    cam = make_cam([4, 4, 4], [50, 60, 70])
    md = builder.build(0, cam)
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills, md.decode_query_len) == (3, 12, 0, 4)
    assert md.decode_num_splits == split_count(3, 8, builder.num_sms, TQ4_PER_SM)
    assert md.decode_query_start_loc is cam.query_start_loc and md.decode_seq_lens is cam.seq_lens
    # Padded to a captured size: an empty request at the end, still one decode batch of 4 slots.
    padded = builder.build(0, make_cam([4, 4, 0], [50, 60, 0]))
    assert (padded.num_decodes, padded.num_decode_tokens, padded.decode_query_len) == (3, 8, 4)
    mixed = builder.build(0, make_cam([1, 4, 2, 9], [30, 40, 50, 9]))  # drafts of several lengths, then a prefill
    assert (mixed.num_decodes, mixed.num_decode_tokens, mixed.decode_query_len, mixed.num_prefills) == (3, 7, 4, 1)
    single = builder.build(0, make_cam([1, 1], [30, 40]))
    assert (single.num_decodes, single.decode_query_len) == (2, 1)


def test_verification_batches_never_take_the_dense_path(speculative_builder):
    """From 64 verifications (256 tokens) a prefill would reach the dense path, whose host-side offsets a graph would
    replay stale: verifications are decodes; a prefill chunk longer than a verification still takes it."""
    from turboquant_vllm.vllm.metadata import DENSE_PREFILL_MIN_TOKENS

    builder = speculative_builder
    n = DENSE_PREFILL_MIN_TOKENS // 4
    verify = builder.build(0, make_cam([4] * n, [100 + i for i in range(n)]))
    assert verify.num_decode_tokens == 4 * n and verify.num_prefills == 0 and verify.prefill_cu_seqlens_k is None
    chunk = builder.build(0, make_cam([DENSE_PREFILL_MIN_TOKENS], [DENSE_PREFILL_MIN_TOKENS + 10]))
    assert chunk.prefill_cu_seqlens_k is not None


def test_decode_query_len_follows_vllm_and_the_kernel_limit():
    from types import SimpleNamespace

    from turboquant_vllm.ops.attention import MAX_DECODE_QUERY_LEN
    from turboquant_vllm.vllm.metadata import decode_query_len

    def spec(k, parallel=False, v2=False):
        return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k, parallel_drafting=parallel),
                               use_v2_model_runner=v2)

    assert decode_query_len(SimpleNamespace(speculative_config=None)) == 1
    assert [decode_query_len(spec(k)) for k in (1, 3, 7)] == [2, 4, 8]
    # V1's parallel drafter appends a mask slot per draft; V2's verifications are 1 + drafts
    assert decode_query_len(spec(3, parallel=True)) == 7
    assert decode_query_len(spec(3, parallel=True, v2=True)) == 4
    assert decode_query_len(spec(40)) == MAX_DECODE_QUERY_LEN


def test_batch_invariant_mode_runs_one_split_and_no_dense_path(vllm_config, bf16_default, monkeypatch):
    from turboquant_vllm.vllm import compat
    from turboquant_vllm.vllm.metadata import DENSE_PREFILL_MIN_TOKENS

    monkeypatch.setattr(compat, "batch_invariant", lambda: True)
    monkeypatch.setattr(compat, "flash_attn_varlen", lambda: ("flash_attn_varlen_func", 3))  # as on a GPU
    make_layers(vllm_config, 1)
    builder = make_builder(vllm_config, ["model.layers.0.self_attn.attn"])
    assert builder.batch_invariant and not builder.dense_prefill
    md = builder.build(0, make_cam([1, 1, DENSE_PREFILL_MIN_TOKENS], [30, 5, DENSE_PREFILL_MIN_TOKENS + 7]))
    assert md.batch_invariant and md.decode_num_splits == 1 and md.prefill_cu_seqlens_k is None
