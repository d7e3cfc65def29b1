"""One layer's attention in one decode step, as the vLLM backends run it: the host's cost of issuing it (eager, as
in steps that mix prefills and decodes, which run attention between piecewise CUDA graphs) and the GPU's (a CUDA
graph replay, as in captured decode steps).

Ours: store_kv (the step's keys and values, with the fused query rotation) + paged_attention (decode kernel and
merge), with the arguments the backend passes (validate=False, the shared workspace). FLASH_ATTN: vLLM's
reshape_and_cache_flash + FlashAttention-3 over the bf16 cache. A small model's step is ~30 such layers: where
the host's microseconds exceed the GPU's, eager steps are bound by issuing launches, not by the cache.

A mixed step (--prefill P: the decodes plus one sequence's P new tokens after as many cached as a decode's context)
runs as the backend runs it: one store launch that also rotates the queries attention takes, then the decodes, then
the prefill, through the general kernel below DENSE_PREFILL_MIN_TOKENS and through FlashAttention over the expanded
pages from it; ", separate rotation" rows rotate the queries in launches of their own, as the backend did in mixed
steps before the store took them. FLASH_ATTN: one reshape_and_cache_flash and one varlen call for the whole step.

    python -m benchmarks layer_step [--shapes 64x512,8x2048] [--heads 9/3 --head-dim 64] [--prefill 128,512]
        [--out PATH]
Writes benchmarks/results/layer_step/<gpu>-<Q>q<KV>kv-d<D>.{json,md} (default: SmolLM2-135M's 9 / 3 heads, d 64).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from turboquant_vllm.bench import BLOCK, Batch, Shape, time_graph
from turboquant_vllm.core.layout import CacheLayout
from turboquant_vllm.core.presets import get_preset
from turboquant_vllm.ops import attention_workspace_shape, decode_num_splits, paged_attention, store_kv

from . import common

NAME = "layer_step"
SHAPES = [(64, 512), (8, 2048), (256, 512)]
HOST_CALLS = 2000


def host_us(fn, calls: int = HOST_CALLS) -> float:
    """Mean microseconds to issue fn, the GPU drained first: the host's time while the GPU keeps up; the GPU's once
    the launch queue fills."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    return issued / calls * 1e6


def ours_step(b: Batch, preset: str):
    s = b.shape
    layout = CacheLayout(get_preset(preset), s.head_dim, s.kv_heads, BLOCK)
    cache = torch.zeros(layout.cache_shape(b.num_blocks), dtype=torch.uint8, device="cuda")
    for ids, k, v in b.slot_chunks():
        store_kv(k, v, cache, (ids[:, None] * BLOCK + torch.arange(BLOCK, device="cuda")).flatten(), layout)
    splits = decode_num_splits(s.batch, layout)
    ws = torch.empty(attention_workspace_shape(s.batch, s.q_heads, s.head_dim, splits), dtype=torch.float32,
                     device="cuda")
    key = torch.randn(s.batch, s.kv_heads, s.head_dim, dtype=torch.bfloat16, device="cuda")
    slots = b.block_table[:, -1].long() * BLOCK + (s.context - 1) % BLOCK  # each sequence's last slot
    out = torch.empty_like(b.query)
    scale = s.head_dim**-0.5

    def run():
        rotated = store_kv(key, key, cache, slots, layout, query=b.query, query_scale=scale, validate=False)
        paged_attention(b.query, cache, layout, b.block_table, b.qsl, b.seq_lens, max_query_len=1, scale=scale,
                        out=out, workspace=ws, num_splits=splits, rotated_query=rotated, decode=True, validate=False)
    return run


class Mixed:
    """The batch's decodes plus one prefill sequence: `prefill` new tokens after `context` cached ones, its pages
    after the batch's; the step's new keys at the decodes' last slots and the prefill's slots."""

    def __init__(self, b: Batch, prefill: int):
        s, dev = b.shape, b.query.device
        self.b, self.prefill, self.tokens = b, prefill, s.batch + prefill
        width = -(-(s.context + prefill) // BLOCK)
        self.num_blocks = b.num_blocks + width
        table = torch.arange(b.num_blocks, self.num_blocks, dtype=torch.int32, device=dev)[None]
        self.block_table = torch.zeros(s.batch + 1, width, dtype=torch.int32, device=dev)
        self.block_table[: s.batch, : b.block_table.shape[1]] = b.block_table
        self.block_table[s.batch] = table
        self.prefill_block_table = table
        positions = torch.arange(s.context, s.context + prefill, device=dev)
        self.slots = torch.cat([b.block_table[:, -1].long() * BLOCK + (s.context - 1) % BLOCK,
                                table[0, positions // BLOCK].long() * BLOCK + positions % BLOCK])
        self.seq_lens = torch.cat([b.seq_lens, torch.tensor([s.context + prefill], dtype=torch.int32, device=dev)])
        self.qsl = torch.cat([b.qsl, torch.tensor([self.tokens], dtype=torch.int32, device=dev)])
        self.prefill_qsl = torch.tensor([0, prefill], dtype=torch.int32, device=dev)
        self.prefill_cu_k = torch.tensor([0, s.context + prefill], dtype=torch.int32, device=dev)
        gen = torch.Generator().manual_seed(2)
        self.query = torch.randn(self.tokens, s.q_heads, s.head_dim, generator=gen).to(torch.bfloat16).to(dev)
        self.key = torch.randn(self.tokens, s.kv_heads, s.head_dim, generator=gen).to(torch.bfloat16).to(dev)


def ours_mixed_step(m: Mixed, preset: str, separate_rotation: bool):
    """The step's launches as the backend issues them; the closure returns the step's attention output (the
    cache's layout and the cache come with it: run.layout, run.cache)."""
    from turboquant_vllm.vllm.impl import dense_prefill_attention, store_rotated_queries
    from turboquant_vllm.vllm.metadata import DENSE_PREFILL_MIN_TOKENS

    b, s, nd, dev = m.b, m.b.shape, m.b.shape.batch, m.query.device
    layout = CacheLayout(get_preset(preset), s.head_dim, s.kv_heads, BLOCK)
    cache = torch.zeros(layout.cache_shape(m.num_blocks), dtype=torch.uint8, device=dev)
    for ids, k, v in b.slot_chunks():
        store_kv(k, v, cache, (ids[:, None] * BLOCK + torch.arange(BLOCK, device=dev)).flatten(), layout)
    splits = decode_num_splits(nd, layout)
    ws = torch.empty(max(attention_workspace_shape(nd, s.q_heads, s.head_dim, splits)[0],
                         attention_workspace_shape(m.prefill, s.q_heads, s.head_dim, 1)[0]),
                     dtype=torch.float32, device=dev)
    out = torch.empty_like(m.query)
    scale = s.head_dim**-0.5
    dense = m.prefill >= DENSE_PREFILL_MIN_TOKENS
    rotate = 0 if separate_rotation else store_rotated_queries(nd, m.prefill, dense_prefill=dense,
                                                                 batch_invariant=False)
    total = s.context + m.prefill
    common = dict(scale=scale, workspace=ws, validate=False)

    def run():
        rotated = store_kv(m.key, m.key, cache, m.slots, layout, query=m.query[:rotate] if rotate else None,
                           query_scale=scale, validate=False)
        paged_attention(m.query[:nd], cache, layout, b.block_table, b.qsl, b.seq_lens, max_query_len=1,
                        out=out[:nd], num_splits=splits, rotated_query=rotated and rotated.tokens(0, nd), decode=True,
                        **common)
        if dense:
            dense_prefill_attention(m.query[nd:], cache, layout, m.prefill_block_table, m.prefill_qsl,
                                    m.seq_lens[nd:], m.prefill_cu_k, total_k=total, max_query_len=m.prefill,
                                    max_seq_len=total, scale=scale, sliding_window=None, softcap=None, out=out[nd:],
                                    validate=False)
        else:
            paged_attention(m.query[nd:], cache, layout, m.prefill_block_table, m.prefill_qsl, m.seq_lens[nd:],
                            max_query_len=m.prefill, out=out[nd:], num_splits=1,
                            rotated_query=rotated and rotated.tokens(nd, m.tokens), **common)
        return out
    run.layout, run.cache = layout, cache
    return run


def flash_mixed_step(m: Mixed):
    from vllm import _custom_ops as ops

    from turboquant_vllm.vllm import compat

    flash_attn_varlen_func, _ = compat.flash_attn_varlen()
    b, s = m.b, m.b.shape
    extra = m.num_blocks - b.num_blocks
    k_cache = torch.cat([b.k_cache, torch.zeros(extra, *b.k_cache.shape[1:], dtype=b.k_cache.dtype, device="cuda")])
    v_cache = torch.cat([b.v_cache, torch.zeros_like(k_cache[:extra])])
    one = torch.ones((), dtype=torch.float32, device="cuda")
    out = torch.empty_like(m.query)

    def run():
        ops.reshape_and_cache_flash(m.key, m.key, k_cache, v_cache, m.slots, "auto", one, one)
        flash_attn_varlen_func(m.query, k_cache, v_cache, max_seqlen_q=m.prefill, cu_seqlens_q=m.qsl,
                               max_seqlen_k=s.context + m.prefill, seqused_k=m.seq_lens,
                               softmax_scale=s.head_dim**-0.5, causal=True, block_table=m.block_table, out=out,
                               fa_version=3)
    return run


def flash_step(b: Batch):
    from vllm import _custom_ops as ops

    from turboquant_vllm.vllm import compat

    flash_attn_varlen_func, _ = compat.flash_attn_varlen()
    s = b.shape
    key = torch.randn(s.batch, s.kv_heads, s.head_dim, dtype=torch.bfloat16, device="cuda")
    slots = b.block_table[:, -1].long() * BLOCK + (s.context - 1) % BLOCK
    one = torch.ones((), dtype=torch.float32, device="cuda")
    out = torch.empty_like(b.query)

    def run():
        ops.reshape_and_cache_flash(key, key, b.k_cache, b.v_cache, slots, "auto", one, one)
        flash_attn_varlen_func(b.query, b.k_cache, b.v_cache, max_seqlen_q=1, cu_seqlens_q=b.qsl,
                               max_seqlen_k=s.context, seqused_k=b.seq_lens, softmax_scale=s.head_dim**-0.5,
                               causal=True, block_table=b.block_table, out=out, fa_version=3)
    return run


def markdown(rows: list[dict], heads: str) -> str:
    lines = [f"# One layer's attention in a step: host issue time vs GPU time ({heads})", "",
             "Host: mean µs to issue the layer's launches, eager (steps that mix prefills and decodes); where the GPU "
             "is the slower, the launch queue fills and the loop runs at the GPU's pace, so the host figure is at "
             "least the GPU's. GPU: µs of a CUDA-graph replay (captured decode steps). Ours: store_kv with the fused "
             "query rotation + paged_attention; FLASH_ATTN: reshape_and_cache_flash + FlashAttention-3 (bf16). "
             "Prefill: a mixed step's prefill tokens beside the decodes (module docstring).", "",
             "| step | batch x context | prefill | host µs | GPU µs | host / GPU |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['step']} | {r['batch']} x {r['context']} | {r.get('prefill') or ''} | "
                     f"{r['host_us']:.1f} | {r['gpu_us']:.1f} | {r['host_us'] / r['gpu_us']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--shapes", default=",".join(f"{b}x{c}" for b, c in SHAPES), help="BATCHxCONTEXT,...")
    ap.add_argument("--heads", default="9/3", help="Q/KV heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--presets", default="tq4,tq3")
    ap.add_argument("--prefill", default="", help="P,...: also mixed steps, the decodes plus P prefill tokens")
    common.add_out_argument(ap, "benchmarks/results/layer_step/<gpu>-<Q>q<KV>kv-d<D>")
    args = ap.parse_args(argv)
    q_heads, kv_heads = (int(x) for x in args.heads.split("/"))
    command = common.command_line(NAME, argv)
    meta = common.print_header(command)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch, context in (tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")):
        b = Batch(Shape(batch, context, q_heads, kv_heads, args.head_dim), gen)
        steps = {"flash_attn_bf16": lambda: flash_step(b)}
        steps.update({p: (lambda p=p: ours_step(b, p)) for p in args.presets.split(",")})
        cases = [(name, make, None) for name, make in steps.items()]
        for prefill in (int(p) for p in args.prefill.split(",") if p):
            m = Mixed(b, prefill)
            cases.append(("flash_attn_bf16", lambda m=m: flash_mixed_step(m), prefill))
            for p in args.presets.split(","):
                cases += [(p, lambda m=m, p=p: ours_mixed_step(m, p, False), prefill),
                          (f"{p}, separate rotation", lambda m=m, p=p: ours_mixed_step(m, p, True), prefill)]
        for name, make, prefill in cases:
            fn = make()
            row = dict(step=name, batch=batch, context=context, prefill=prefill, q_heads=q_heads, kv_heads=kv_heads,
                       head_dim=args.head_dim, host_us=host_us(fn), gpu_us=time_graph(fn) * 1e3)
            print(f"{name:28s} {batch:4d} x {context:6d} + {prefill or 0:4d}: host {row['host_us']:7.1f} µs, "
                  f"GPU {row['gpu_us']:7.1f} µs", flush=True)
            rows.append(row)
    stem = (common.stem_of(args.out) if args.out else
            common.result_stem(NAME, f"{q_heads}q{kv_heads}kv-d{args.head_dim}"))
    common.write_json(common.with_ext(stem, ".json"), dict(rows=rows), meta)
    common.write_markdown(common.with_ext(stem, ".md"), markdown(rows, f"{q_heads} q / {kv_heads} KV heads, d "
                                                                      f"{args.head_dim}"), meta)
    print(f"wrote {Path(stem)}.json / .md")


if __name__ == "__main__":
    main()
