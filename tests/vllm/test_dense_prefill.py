"""GPU: the long-prefill path (expand the compressed context, then FlashAttention) equals the reference."""

import math

import pytest
import torch

from tests.kernels.cases import make_paged_batch
from turboquant_vllm.core.reference import paged_attention_reference, store_kv_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("preset", ["tq4", "tq3", "k3v2"])
@pytest.mark.parametrize("head_dim,group", [(128, 4), (64, 8), (256, 1)])
@pytest.mark.parametrize("window,softcap", [(None, None), (100, 30.0)])
def test_dense_prefill_matches_reference(preset, head_dim, group, window, softcap):
    from turboquant_vllm.vllm.backend import dense_prefill_attention

    gen = torch.Generator().manual_seed(head_dim + group)
    seq_lens, q_lens = [900, 300, 1200], [900, 45, 400]  # prefill, chunk after a cached prefix, chunk
    b = make_paged_batch(gen, preset, head_dim, 2, 16, seq_lens, torch.bfloat16, "cuda")
    store_kv_reference(b.keys, b.values, b.kv_cache, b.slot_mapping, b.layout)
    qsl = torch.tensor([0, 900, 945, 1345], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 900, 1200, 2400], dtype=torch.int32, device="cuda")
    query = torch.randn(1345, 2 * group, head_dim, generator=gen).to(torch.bfloat16).cuda()
    out = torch.full_like(query, float("nan"))
    scale = 1 / math.sqrt(head_dim)
    dense_prefill_attention(query, b.kv_cache, b.layout, b.block_table, qsl, b.seq_lens, cu_k, total_k=2400,
                            max_query_len=900, max_seq_len=1200, scale=scale, sliding_window=window, softcap=softcap,
                            out=out)
    ref = paged_attention_reference(query, b.kv_cache, b.layout, b.block_table, qsl, b.seq_lens, scale, window,
                                    softcap)
    assert not torch.isnan(out).any()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
