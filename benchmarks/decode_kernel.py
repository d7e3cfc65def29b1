"""Decode attention alone: TurboQuant kernels vs FlashAttention-3 (bf16, fp8) and vLLM's in-tree TurboQuant.

FlashAttention and ours read caches of the same contents (random K/V, 32 query / 8 KV heads, d = 128,
block size 16, pages shuffled). Every callable is captured in a CUDA graph and timed by
replay, so launch overhead is out of the comparison for all of them alike.

    python benchmarks/decode_kernel.py            # on a GPU with vLLM importable
Writes benchmarks/results/decode_kernel.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch
import triton

from turboquant_vllm.core.layout import CacheLayout
from turboquant_vllm.core.presets import get_preset
from turboquant_vllm.kernels import paged_attention, store_kv
from turboquant_vllm.kernels.attention import attention_workspace_shape, default_num_splits

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
SHAPES = [(64, 8192), (32, 32768), (8, 131072), (1, 131072)]
RESULTS = Path(__file__).parent / "results"


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100)
    return 2 * src.numel() / (ms * 1e-3)


def bench(fn) -> float:
    """Median ms of a CUDA-graph replay of fn."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=200)


class Batch:
    def __init__(self, batch: int, context: int, gen: torch.Generator):
        self.batch, self.context = batch, context
        blocks_per_seq = context // BLOCK
        self.num_blocks = batch * blocks_per_seq
        perm = torch.randperm(self.num_blocks, generator=gen).to("cuda")
        self.block_table = perm.view(batch, blocks_per_seq).to(torch.int32)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        self.query = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16).cuda()
        # bf16 cache in FlashAttention's layout (num_blocks, block, kv_heads, d); same contents for all kernels
        self.k_cache = torch.randn(self.num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        self.v_cache = torch.randn_like(self.k_cache)

    def slot_chunks(self, chunk_blocks: int = 4096):
        """(physical block ids, K, V) in chunks: token order within a block is the slot offset."""
        for b0 in range(0, self.num_blocks, chunk_blocks):
            ids = torch.arange(b0, min(b0 + chunk_blocks, self.num_blocks), device="cuda")
            yield ids, self.k_cache[ids].flatten(0, 1), self.v_cache[ids].flatten(0, 1)

    def bytes_kv(self, bytes_per_token_per_head: float) -> float:
        meta = self.block_table.numel() * 4 + 2 * self.query.numel() * 2
        return self.batch * self.context * KV_HEADS * bytes_per_token_per_head + meta


def ours(b: Batch, preset: str, splits: int | None = None, **tuning):
    layout = CacheLayout(get_preset(preset), HEAD_DIM, KV_HEADS, BLOCK)
    cache = torch.empty(layout.cache_shape(b.num_blocks), dtype=torch.uint8, device="cuda")
    for ids, k, v in b.slot_chunks():
        slots = (ids[:, None] * BLOCK + torch.arange(BLOCK, device="cuda")).flatten()
        store_kv(k, v, cache, slots, layout)
    splits = splits or default_num_splits(b.batch, KV_HEADS)
    ws = torch.empty(attention_workspace_shape(b.batch, Q_HEADS, HEAD_DIM, splits), dtype=torch.float32, device="cuda")
    out = torch.empty_like(b.query)
    fn = lambda: paged_attention(  # noqa: E731
        b.query, cache, layout, b.block_table, b.qsl, b.seq_lens, max_query_len=1, scale=HEAD_DIM**-0.5, out=out,
        workspace=ws, num_splits=splits, **tuning)
    return fn, layout.bytes_per_token_per_head, cache


def flash(b: Batch, fp8: bool):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    k, v, q = b.k_cache, b.v_cache, b.query
    kw = {}
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        q = q.to(torch.float8_e4m3fn)  # vLLM quantizes queries for the fp8 cache
        ones = torch.ones(b.batch, KV_HEADS, dtype=torch.float32, device="cuda")
        kw = dict(q_descale=ones, k_descale=ones, v_descale=ones)
    out = torch.empty(b.batch, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    fn = lambda: flash_attn_varlen_func(  # noqa: E731
        q, k, v, max_seqlen_q=1, cu_seqlens_q=b.qsl, max_seqlen_k=b.context, seqused_k=b.seq_lens,
        softmax_scale=HEAD_DIM**-0.5, causal=True, block_table=b.block_table, out=out, fa_version=3, **kw)
    return fn, 2 * HEAD_DIM * (1 if fp8 else 2)


def in_tree(b: Batch, preset: str):
    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    from vllm.v1.attention.ops.triton_turboquant_decode import triton_turboquant_decode_attention

    cfg = TurboQuantConfig.from_cache_dtype(preset, HEAD_DIM)
    # Its own byte layout; zero contents (its decode time does not depend on the values).
    cache = torch.zeros(b.num_blocks, BLOCK, KV_HEADS, cfg.slot_size_aligned, dtype=torch.uint8, device="cuda")
    pi = torch.linalg.qr(torch.randn(HEAD_DIM, HEAD_DIM, device="cuda"))[0].contiguous()
    centroids = get_centroids(HEAD_DIM, cfg.centroid_bits).to("cuda", torch.float32)
    fn = lambda: triton_turboquant_decode_attention(  # noqa: E731
        b.query, cache, b.block_table, b.seq_lens, pi, centroids, HEAD_DIM**-0.5, cfg.key_mse_bits,
        cfg.key_packed_size, cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8,
        norm_correction=cfg.norm_correction, PiT=pi.T.contiguous())
    return fn, cfg.slot_size_aligned


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default=",".join(f"{b}x{c}" for b, c in SHAPES))
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--sweep", action="store_true", help="time tile / warp / split choices of ours instead")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    gen = torch.Generator().manual_seed(0)
    if args.sweep:
        return sweep(shapes, gen)
    peak = copy_bandwidth()
    print(f"measured copy bandwidth: {peak / 1e12:.2f} TB/s")
    rows = []
    for batch, context in shapes:
        b = Batch(batch, context, gen)
        kernels = {
            "fa3_bf16": lambda: flash(b, False),
            "fa3_fp8": lambda: flash(b, True),
            "tq4": lambda: ours(b, "tq4")[:2],
            "tq3": lambda: ours(b, "tq3")[:2],
            "turboquant_4bit_nc": lambda: in_tree(b, "turboquant_4bit_nc"),
            "turboquant_3bit_nc": lambda: in_tree(b, "turboquant_3bit_nc"),
        }
        base = None
        for name, make in kernels.items():
            try:
                fn, bpt = make()
                ms = bench(fn)
            except Exception as e:  # a kernel that cannot run here is reported, not hidden
                print(f"{name} {batch}x{context}: failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            base = ms if name == "fa3_bf16" else base
            moved = b.bytes_kv(bpt)
            rows.append(dict(kernel=name, batch=batch, context=context, time_ms=ms, gbps=moved / ms / 1e6,
                             bytes_moved=moved, frac_of_copy_bw=moved / (ms * 1e-3) / peak,
                             speedup_vs_bf16=(base / ms) if base else None))
            print(f"{name:20s} {batch:3d} x {context:6d}: {ms:8.3f} ms  {moved / ms / 1e6:7.0f} GB/s  "
                  f"{rows[-1]['frac_of_copy_bw']:.0%} of copy  x{rows[-1]['speedup_vs_bf16'] or 0:.2f} vs bf16")
            torch.cuda.empty_cache()
        # Store kernel: one decode step's new tokens (batch tokens, all KV heads) of one layer
        layout = CacheLayout(get_preset("tq4"), HEAD_DIM, KV_HEADS, BLOCK)
        cache = torch.empty(layout.cache_shape(b.num_blocks), dtype=torch.uint8, device="cuda")
        k = torch.randn(batch, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        slots = torch.randperm(b.num_blocks * BLOCK, device="cuda")[:batch]
        ms = bench(lambda: store_kv(k, k, cache, slots, layout))
        rows.append(dict(kernel="tq4_store", batch=batch, context=context, time_ms=ms, gbps=None,
                         speedup_vs_bf16=None))
        print(f"{'tq4_store':20s} {batch:3d} x {context:6d}: {ms:8.4f} ms")
        del b, cache
        torch.cuda.empty_cache()
    write(rows, peak, Path(args.out))


def sweep(shapes, gen) -> None:
    """Tile, warp, pipeline-stage and split choices of ours (tq4), one line each."""
    configs = [(n, w, st) for n, w in ((64, 4), (128, 4), (128, 8), (256, 8)) for st in (1, 2, 3)]
    for batch, context in shapes:
        b = Batch(batch, context, gen)
        base = default_num_splits(batch, KV_HEADS)
        for block_n, num_warps, stages in configs:
            for splits in (base, 2 * base):
                try:
                    fn, bpt, _ = ours(b, "tq4", splits, block_n=block_n, num_warps=num_warps, num_stages=stages)
                    ms = bench(fn)
                except Exception as e:
                    print(f"sweep tq4 {batch}x{context} n{block_n} w{num_warps} st{stages} s{splits}: {e!r}"[:300])
                    continue
                print(f"sweep tq4 {batch}x{context} block_n={block_n} warps={num_warps} stages={stages} "
                      f"splits={splits}: {ms:.3f} ms {b.bytes_kv(bpt) / ms / 1e6:.0f} GB/s")
        del b
        torch.cuda.empty_cache()


def write(rows, peak, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), copy_bandwidth_tbps=peak / 1e12, q_heads=Q_HEADS,
                kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK, command="python benchmarks/decode_kernel.py")
    (out / "decode_kernel.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"Decode attention, {Q_HEADS} q / {KV_HEADS} KV heads, d={HEAD_DIM}, block {BLOCK}, "
             f"{meta['device']}, copy bandwidth {peak / 1e12:.2f} TB/s\n",
             "| kernel | batch x context | time (ms) | GB/s | of copy BW | speed-up vs FA3 bf16 |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        gb = f"{r['gbps']:.0f}" if r["gbps"] else ""
        fr = f"{r['frac_of_copy_bw']:.0%}" if r.get("frac_of_copy_bw") else ""
        sp = f"{r['speedup_vs_bf16']:.2f}x" if r["speedup_vs_bf16"] else ""
        lines.append(f"| {r['kernel']} | {r['batch']} x {r['context']} | {r['time_ms']:.4f} | {gb} | {fr} | {sp} |")
    (out / "decode_kernel.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernels = [k for k in dict.fromkeys(r["kernel"] for r in rows) if k != "tq4_store"]
    shapes = list(dict.fromkeys((r["batch"], r["context"]) for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(kernels)
    for i, k in enumerate(kernels):
        ys = [next((r["time_ms"] for r in rows if r["kernel"] == k and (r["batch"], r["context"]) == s), math.nan)
              for s in shapes]
        ax.bar([j + i * width for j in range(len(shapes))], ys, width, label=k)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], [f"{b} x {c // 1024}k" for b, c in shapes])
    ax.set_ylabel("decode attention time (ms, lower is better)")
    ax.set_title(f"Decode attention on {meta['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "decode_kernel.png", dpi=120)


if __name__ == "__main__":
    main()
