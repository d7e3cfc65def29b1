"""One layer's attention work in a prefill step: ours vs FLASH_ATTN bf16, side by side.

A step's new tokens are written to the cache and attended causally over their sequence's context
(a cached prefix + the new tokens), as vLLM does with chunked prefill:
- bf16: vLLM's reshape_and_cache_flash + FlashAttention-3 over the paged bf16 cache (what FLASH_ATTN runs);
- ours (tq4, tq3): store_kv + the backend's dense prefill (expand the context, FlashAttention-3), then each of
  the three alone ("tq4 store", "tq4 expand", "tq4 attention");
with the e2e model's shape (16 query / 4 KV heads, d 128, block 16), random bf16 inputs.
Times are medians of triton's do_bench, no CUDA graph (vLLM does not capture prefill steps).

    python -m benchmarks prefill_attention [--steps 2x8192+0,1x8192+24576,16x1024+0] [--kv bf16,tq4,tq3] [--out PATH]
Writes benchmarks/results/prefill_attention/<gpu>-16q4kv[-<steps>].{json,md,png} (the steps only where they are not
the default ones).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from turboquant_vllm.core.layout import CacheLayout
from turboquant_vllm.core.presets import get_preset
from turboquant_vllm.ops import store_kv
from turboquant_vllm.vllm import compat
from turboquant_vllm.vllm.impl import dense_prefill_attention

from . import common

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 4, 128, 16
STEPS = "2x8192+0,1x8192+24576,16x1024+0"
NAME = "prefill_attention"


def default_stem(steps: str, gpu: str | None = None) -> Path:
    """benchmarks/results/prefill_attention/<gpu>-16q4kv[-<steps>]."""
    what = f"{Q_HEADS}q{KV_HEADS}kv" + ("" if steps == STEPS else "-" + steps.replace(",", "-"))
    return common.result_stem(NAME, what, gpu)


class Step:
    """`seqs` sequences, each `new` tokens after a cached prefix of `prefix` tokens, pages shuffled."""

    def __init__(self, seqs: int, new: int, prefix: int, gen: torch.Generator):
        self.seqs, self.new, self.prefix = seqs, new, prefix
        context = prefix + new
        self.blocks_per_seq = math.ceil(context / BLOCK)
        self.num_blocks = seqs * self.blocks_per_seq
        self.block_table = torch.randperm(self.num_blocks, generator=gen).view(seqs, -1).to(torch.int32).cuda()
        self.seq_lens = torch.full((seqs,), context, dtype=torch.int32, device="cuda")
        self.qsl = (torch.arange(seqs + 1, dtype=torch.int32) * new).cuda()
        self.cu_k = (torch.arange(seqs + 1, dtype=torch.int32) * context).cuda()
        pos = torch.arange(prefix, context)
        self.new_slots = torch.cat([  # slots of the step's new tokens
            self.block_table[s, pos // BLOCK].cpu().long() * BLOCK + pos % BLOCK for s in range(seqs)]).cuda()
        pos = torch.arange(context)
        self.all_slots = torch.cat([
            self.block_table[s, pos // BLOCK].cpu().long() * BLOCK + pos % BLOCK for s in range(seqs)]).cuda()
        tokens = seqs * new
        self.query = torch.randn(tokens, Q_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16).cuda()
        self.key = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16).cuda()
        self.value = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16).cuda()
        self.prefix_kv = torch.randn(seqs * context, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16).cuda()

    @property
    def name(self) -> str:
        return f"{self.seqs}x{self.new}+{self.prefix}"

    def flops(self) -> float:
        return causal_flops(self.seqs, self.new, self.prefix)


def causal_flops(seqs: int, new: int, prefix: int) -> float:
    """Causal attention FLOPs (QK^T and PV) of `new` queries per sequence after `prefix` cached tokens."""
    keys = new * prefix + new * (new + 1) // 2  # keys the queries attend, the diagonal included
    return 4 * HEAD_DIM * Q_HEADS * seqs * keys


def flash_bf16(s: Step):
    from vllm import _custom_ops as ops

    flash, version = compat.flash_attn_varlen()
    k_cache = torch.randn(s.num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    one = torch.ones((), dtype=torch.float32, device="cuda")
    out = torch.empty_like(s.query)

    def step():
        ops.reshape_and_cache_flash(s.key, s.value, k_cache, v_cache, s.new_slots, "auto", one, one)
        flash(s.query, k_cache, v_cache, max_seqlen_q=s.new, cu_seqlens_q=s.qsl, max_seqlen_k=s.prefix + s.new,
              seqused_k=s.seq_lens, softmax_scale=HEAD_DIM**-0.5, causal=True, block_table=s.block_table, out=out,
              fa_version=version)
    return step


def ours(s: Step, preset: str) -> dict:
    """The step, then its parts alone: the store, the expansion of the context, FlashAttention over it."""
    from turboquant_vllm.ops import dequantize_pages

    layout = CacheLayout(get_preset(preset), HEAD_DIM, KV_HEADS, BLOCK)
    cache = torch.zeros(layout.cache_shape(s.num_blocks), dtype=torch.uint8, device="cuda")
    store_kv(s.prefix_kv, s.prefix_kv, cache, s.all_slots, layout)  # the cached prefix (and every slot) filled
    out = torch.empty_like(s.query)
    total_k, max_k = s.seqs * (s.prefix + s.new), s.prefix + s.new
    flash, version = compat.flash_attn_varlen()
    k, v = dequantize_pages(cache, layout, s.block_table, s.seq_lens, s.cu_k, total_k, max_k, s.query.dtype)

    def step():
        store_kv(s.key, s.value, cache, s.new_slots, layout)
        dense_prefill_attention(s.query, cache, layout, s.block_table, s.qsl, s.seq_lens, s.cu_k, total_k=total_k,
                                max_query_len=s.new, max_seq_len=max_k, scale=HEAD_DIM**-0.5,
                                sliding_window=None, softcap=None, out=out)
    return {
        preset: step,
        f"{preset} store": lambda: store_kv(s.key, s.value, cache, s.new_slots, layout),
        f"{preset} expand": lambda: dequantize_pages(cache, layout, s.block_table, s.seq_lens, s.cu_k, total_k, max_k,
                                                     s.query.dtype),
        f"{preset} attention": lambda: flash(s.query, k, v, max_seqlen_q=s.new, cu_seqlens_q=s.qsl, max_seqlen_k=max_k,
                                             cu_seqlens_k=s.cu_k, softmax_scale=HEAD_DIM**-0.5, causal=True,
                                             out=out, fa_version=version),
    }


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--steps", default=STEPS, help="SEQSxNEW+PREFIX,...")
    ap.add_argument("--kv", default="bf16,tq4,tq3")
    common.add_out_argument(ap, "benchmarks/results/prefill_attention/<gpu>-16q4kv")
    args = ap.parse_args(argv)
    provenance = common.provenance(common.command_line(NAME, argv))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for spec in args.steps.split(","):
        shape, prefix = spec.split("+")
        seqs, new = (int(x) for x in shape.split("x"))
        s = Step(seqs, new, int(prefix), gen)
        base = None
        for kv in args.kv.split(","):
            for name, fn in ({"bf16": flash_bf16(s)} if kv == "bf16" else ours(s, kv)).items():
                fn()
                torch.cuda.synchronize()
                ms = common.time_ms(fn, cuda_graph=False, rep=200)  # vLLM does not capture prefill steps
                base = ms if name == "bf16" else base
                whole = name in ("bf16", kv)  # the parts of a step get no TFLOP/s or ratio
                rows.append(dict(kv=name, step=s.name, seqs=seqs, new_tokens=new, prefix=s.prefix, time_ms=ms,
                                 tflops=s.flops() / ms / 1e9 if whole else None,
                                 vs_bf16=(base / ms) if base and whole else None))
                print(f"{name:14s} {s.name:>14s}: {ms:8.3f} ms  x{rows[-1]['vs_bf16'] or 0:.2f} vs bf16", flush=True)
        del s
        torch.cuda.empty_cache()
    write(rows, common.stem_of(args.out) if args.out else default_stem(args.steps), provenance)


def write(rows, stem: Path, provenance: dict) -> None:
    """stem.json (meta + rows), stem.md (the table), stem.png (time per step and KV cache)."""
    meta = dict(device=provenance["gpu"], q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK)
    common.write_json(common.with_ext(stem, ".json"), dict(meta=meta, rows=rows), provenance)
    lines = [f"Prefill attention of one layer (store + attention), {Q_HEADS} q / {KV_HEADS} KV heads, d={HEAD_DIM}, "
             f"{meta['device']}; step = sequences x new tokens + cached prefix\n",
             "| kv | step | time (ms) | attention TFLOP/s | speed vs bf16 |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        sp = f"{r['vs_bf16']:.2f}x" if r["vs_bf16"] else ""
        tf = f"{r['tflops']:.0f}" if r["tflops"] else ""
        lines.append(f"| {r['kv']} | {r['step']} | {r['time_ms']:.3f} | {tf} | {sp} |")
    common.write_markdown(common.with_ext(stem, ".md"), "\n".join(lines) + "\n", provenance)
    print("\n".join(lines))
    steps = list(dict.fromkeys(r["step"] for r in rows))
    kvs = list(dict.fromkeys(r["kv"] for r in rows if r["tflops"]))  # whole steps only
    common.grouped_bars(common.with_ext(stem, ".png"), rows, kvs, "kv", steps, lambda r: r["step"], steps,
                        "one layer's prefill attention (ms, lower is better)",
                        f"Prefill attention on {meta['device']}", (8, 4))


if __name__ == "__main__":
    main()
