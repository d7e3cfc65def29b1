"""`turboquant-vllm verify --kernels`: the store and decode attention kernels once on random data, against the float32
reference over the same compressed cache. On a CPU the kernels run through Triton's interpreter."""

from __future__ import annotations

import math
import os

ATTENTION_TOLERANCE = 1e-2  # the kernels' bf16 tolerance against the float32 reference (tests/ops)
KEY_ERROR_SLACK = 1.1  # key error at most this times the Lloyd-Max optimum's sqrt(distortion)


def kernel_verdict(att_err: float, k_err: float, k_bound: float, k_bits: int) -> tuple[bool, str]:
    att_ok, k_ok = att_err < ATTENTION_TOLERANCE, k_err < k_bound
    return att_ok and k_ok, (f"kernels: {'ok' if att_ok and k_ok else 'FAILED'} (attention error "
                             f"{'<' if att_ok else '>='} {ATTENTION_TOLERANCE:.0e}, key error {'<' if k_ok else '>='} "
                             f"{k_bound:.4f} = {KEY_ERROR_SLACK} x the {k_bits}-bit Lloyd-Max optimum)")


def kernel_check(preset_name: str, head_dim: int, context: int) -> tuple[bool, list[str], dict]:
    """Store random K/V of two sequences (context and context // 2 + 1 tokens) with the store kernel, run decode
    attention over them; (ok, report lines, JSON record)."""
    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import
    from ..core.codebook import lloyd_max
    from ..core.layout import CacheLayout
    from ..core.presets import get_preset
    from ..ops import paged_attention, store_kv
    from ..ops.attention.naive import paged_attention_reference
    from ..ops.dequant.naive import read_kv_reference

    device = "cuda" if on_gpu else "cpu"
    gen = torch.Generator().manual_seed(0)
    d, kv_heads, q_heads, bs = head_dim, 2, 8, 16
    seq_lens = [context, context // 2 + 1]
    layout = CacheLayout(get_preset(preset_name), d, kv_heads, bs)
    blocks = [math.ceil(n / bs) for n in seq_lens]
    table = torch.arange(sum(blocks), dtype=torch.int32).split(blocks)
    block_table = torch.nn.utils.rnn.pad_sequence(list(table), batch_first=True).to(device)
    cache = torch.zeros(layout.cache_shape(sum(blocks)), dtype=torch.uint8, device=device)
    keys = torch.randn(sum(seq_lens), kv_heads, d, generator=gen).to(torch.bfloat16).to(device)
    values = torch.randn(sum(seq_lens), kv_heads, d, generator=gen).to(torch.bfloat16).to(device)
    slots = torch.cat([table[i].long().repeat_interleave(bs)[:n] * bs + torch.arange(n) % bs
                       for i, n in enumerate(seq_lens)]).to(device)
    store_kv(keys, values, cache, slots, layout)
    k_hat, _ = read_kv_reference(cache, block_table[0], seq_lens[0], layout)
    k_err = ((k_hat - keys[: seq_lens[0]].float()).norm() / keys[: seq_lens[0]].float().norm()).item()
    query = torch.randn(2, q_heads, d, generator=gen).to(torch.bfloat16).to(device)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = torch.empty_like(query)
    paged_attention(query, cache, layout, block_table, qsl, lens, max_query_len=1, scale=d**-0.5, out=out)
    ref = paged_attention_reference(query, cache, layout, block_table, qsl, lens, d**-0.5)
    att_err = ((out.float() - ref).norm() / ref.norm()).item()
    k_bound = KEY_ERROR_SLACK * math.sqrt(lloyd_max(layout.preset.k_bits, d).distortion)
    where = "GPU (native Triton kernels)" if on_gpu else "CPU (Triton interpreter)"
    ok, verdict = kernel_verdict(att_err, k_err, k_bound, layout.preset.k_bits)
    lines = [f"kernels on {where}: preset {layout.preset.name}, head_dim {d}, contexts {seq_lens}",
             (f"  KV cache: {layout.bytes_per_token_per_head} B per token per KV head vs {4 * d} B bf16 "
              f"-> {layout.preset.capacity_vs_bf16(d):.2f}x compression"),
             f"  key reconstruction relative error (quantization): {k_err:.4f} (bound {k_bound:.4f})",
             (f"  decode attention vs float32 reference over the same compressed cache: relative error {att_err:.2e} "
              f"(bound {ATTENTION_TOLERANCE:.0e})"),
             verdict]
    record = {"device": where, "preset": layout.preset.name, "head_dim": d, "contexts": seq_lens,
              "key_error": k_err, "key_error_bound": k_bound, "attention_error": att_err,
              "attention_error_bound": ATTENTION_TOLERANCE, "ok": ok}
    return ok, lines, record
