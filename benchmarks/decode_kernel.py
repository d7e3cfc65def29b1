"""Decode attention alone: TurboQuant kernels vs FlashAttention-3 (bf16, fp8) and vLLM's in-tree TurboQuant.

FlashAttention and ours read caches of the same contents (random K/V, 32 query / 8 KV heads, d = 128,
block size 16, pages shuffled). Every callable is captured in a CUDA graph and timed by
replay, so launch overhead is out of the comparison for all of them alike.

    python benchmarks/decode_kernel.py            # on a GPU with vLLM importable
Writes benchmarks/results/decode_kernel.{json,md,png}.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

from turboquant_vllm.bench import Batch, Shape, copy_bandwidth, flash, measure, ours, table, time_graph
from turboquant_vllm.core.layout import CacheLayout
from turboquant_vllm.core.presets import get_preset
from turboquant_vllm.kernels import store_kv
from turboquant_vllm.kernels.attention import default_num_splits

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
SHAPES = [(64, 8192), (32, 32768), (8, 131072), (1, 131072)]
RESULTS = Path(__file__).parent / "results"
sys.path.insert(0, str(Path(__file__).parent))
from plot import grouped_bars  # noqa: E402


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
        b = Batch(Shape(batch, context, Q_HEADS, KV_HEADS, HEAD_DIM), gen)
        kernels = {
            "fa3_bf16": functools.partial(flash, b, False),
            "fa3_fp8": functools.partial(flash, b, True),
            "tq4": functools.partial(ours, b, "tq4"),
            "tq3": functools.partial(ours, b, "tq3"),
            "turboquant_4bit_nc": functools.partial(in_tree, b, "turboquant_4bit_nc"),
            "turboquant_3bit_nc": functools.partial(in_tree, b, "turboquant_3bit_nc"),
        }
        measured = measure(b, kernels, peak)
        print("\n".join(table(measured)), flush=True)
        rows += measured
        # Store kernel: one decode step's new tokens (batch tokens, all KV heads) of one layer
        layout = CacheLayout(get_preset("tq4"), HEAD_DIM, KV_HEADS, BLOCK)
        cache = torch.empty(layout.cache_shape(b.num_blocks), dtype=torch.uint8, device="cuda")
        k = torch.randn(batch, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        slots = torch.randperm(b.num_blocks * BLOCK, device="cuda")[:batch]
        ms = time_graph(lambda: store_kv(k, k, cache, slots, layout))
        rows.append(dict(kernel="tq4_store", batch=batch, context=context, time_ms=ms, gbps=None,
                         speedup_vs_bf16=None))
        print(f"{'tq4_store':20s} {batch:3d} x {context:6d}: {ms:8.4f} ms")
        del b, cache
        torch.cuda.empty_cache()
    write(rows, peak, Path(args.out))


def sweep(shapes, gen) -> None:
    """Tile, warp, pipeline-stage and split choices of ours (tq4), one line each."""
    configs = [(n, w, st) for n, w in ((32, 1), (64, 1), (64, 2), (128, 4), (256, 8)) for st in (2, 3, 4)]
    for batch, context in shapes:
        b = Batch(Shape(batch, context, Q_HEADS, KV_HEADS, HEAD_DIM), gen)
        base = default_num_splits(batch, KV_HEADS)
        for block_n, num_warps, stages in configs:
            for splits in (base, 2 * base):
                try:
                    fn, bpt = ours(b, "tq4", splits, block_n=block_n, num_warps=num_warps, num_stages=stages)
                    ms = time_graph(fn)
                except Exception as e:
                    print(f"sweep tq4 {batch}x{context} n{block_n} w{num_warps} st{stages} s{splits}: {e!r}"[:300])
                    continue
                print(f"sweep tq4 {batch}x{context} block_n={block_n} warps={num_warps} stages={stages} "
                      f"splits={splits}: {ms:.3f} ms {b.bytes_moved(bpt) / ms / 1e6:.0f} GB/s")
        del b
        torch.cuda.empty_cache()


def write(rows, peak, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), copy_bandwidth_tbps=peak / 1e12, q_heads=Q_HEADS,
                kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK, command="python benchmarks/decode_kernel.py")
    (out / "decode_kernel.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"Decode attention, {Q_HEADS} q / {KV_HEADS} KV heads, d={HEAD_DIM}, block {BLOCK}, "
             f"{meta['device']}, copy bandwidth {peak / 1e12:.2f} TB/s\n", *table(rows)]
    (out / "decode_kernel.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    kernels = [k for k in dict.fromkeys(r["kernel"] for r in rows) if k != "tq4_store"]
    shapes = list(dict.fromkeys((r["batch"], r["context"]) for r in rows))
    grouped_bars(out / "decode_kernel.png", rows, kernels, "kernel", shapes, lambda r: (r["batch"], r["context"]),
                 [f"{b} x {c // 1024}k" for b, c in shapes], "decode attention time (ms, lower is better)",
                 f"Decode attention on {meta['device']}", (10, 4.5))


if __name__ == "__main__":
    main()
