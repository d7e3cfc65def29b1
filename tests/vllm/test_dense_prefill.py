"""The long-prefill path (expand the compressed context once, then dense attention) equals the
reference. On the GPU it runs vLLM's FlashAttention; on a CPU a plain PyTorch stand-in with
FlashAttention's varlen semantics checks the expansion and the argument wiring."""

import math

import pytest
import torch

from tests.conftest import DEVICE
from tests.ops.cases import make_paged_batch, random_calibration
from turboquant_vllm.ops.attention.naive import paged_attention_reference
from turboquant_vllm.ops.store.naive import store_kv_reference

CASES = [(900, 900), (300, 45), (1200, 400)] if torch.cuda.is_available() else [(90, 90), (60, 7), (70, 30)]


def varlen_attention(q, k, v, *, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, softmax_scale, causal,
                     window_size, softcap, out, fa_version):
    """FlashAttention's varlen contract in plain PyTorch: bottom-right causal mask, (left, right) window."""
    group = q.shape[1] // k.shape[1]
    for i in range(cu_seqlens_q.shape[0] - 1):
        qs, qe, ks, ke = (int(x) for x in (cu_seqlens_q[i], cu_seqlens_q[i + 1], cu_seqlens_k[i], cu_seqlens_k[i + 1]))
        s = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), k[ks:ke].float().repeat_interleave(group, 1))
        s = s * softmax_scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        q_pos = torch.arange(ke - ks - (qe - qs), ke - ks)[:, None]
        k_pos = torch.arange(ke - ks)[None, :]
        allowed = k_pos <= q_pos if causal else torch.ones_like(k_pos <= q_pos)
        if window_size[0] >= 0:
            allowed &= k_pos >= q_pos - window_size[0]
        s = s.masked_fill(~allowed.to(s.device), float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[ks:ke].float().repeat_interleave(group, 1))
    return out


@pytest.mark.matrix
@pytest.mark.parametrize("preset", ["tq4", "tq3", "k3v2"])
@pytest.mark.parametrize("head_dim,group", [(128, 4), (64, 8), (256, 1)])
@pytest.mark.parametrize("window,softcap,calibrated", [(None, None, False), (50, 30.0, False), (50, None, True)])
def test_dense_prefill_matches_reference(preset, head_dim, group, window, softcap, calibrated, monkeypatch):
    from turboquant_vllm.vllm import compat
    from turboquant_vllm.vllm.impl import dense_prefill_attention

    if not torch.cuda.is_available():
        monkeypatch.setattr(compat, "flash_attn_varlen", lambda: (varlen_attention, 3))
    gen = torch.Generator().manual_seed(head_dim + group)
    seq_lens, q_lens = [c[0] for c in CASES], [c[1] for c in CASES]  # a prefill, chunks after cached prefixes
    b = make_paged_batch(gen, preset, head_dim, 2, 16, seq_lens, torch.bfloat16, DEVICE)
    cal = random_calibration(gen, 2, head_dim, DEVICE) if calibrated else None
    store_kv_reference(b.keys, b.values, b.kv_cache, b.slot_mapping, b.layout, cal)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + torch.tensor(seq_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    query = torch.randn(sum(q_lens), 2 * group, head_dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    out = torch.full_like(query, float("nan"))
    scale = 1 / math.sqrt(head_dim)
    dense_prefill_attention(query, b.kv_cache, b.layout, b.block_table, qsl, b.seq_lens, cu_k, total_k=sum(seq_lens),
                            max_query_len=max(q_lens), max_seq_len=max(seq_lens), scale=scale,
                            sliding_window=window, softcap=softcap, out=out, key_calibration=cal)
    ref = paged_attention_reference(query, b.kv_cache, b.layout, b.block_table, qsl, b.seq_lens, scale, window,
                                    softcap, cal)
    assert not torch.isnan(out).any()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
