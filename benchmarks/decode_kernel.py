"""Decode attention alone: TurboQuant kernels vs FlashAttention-3 (bf16, fp8) and vLLM's in-tree TurboQuant.

FlashAttention and ours read caches of the same contents (random K/V, 32 query / 8 KV heads, d = 128,
block size 16, pages shuffled). Every callable is captured in a CUDA graph and timed by
replay, so launch overhead is out of the comparison for all of them alike.

    python -m benchmarks decode_kernel [--shapes 64x8192,32x32768] [--out PATH]   # on a GPU with vLLM importable
Writes benchmarks/results/decode_kernel/<gpu>-32q8kv-<shapes>.{json,md,png} (e.g. h200-32q8kv-64x8k-32x32k).
The launch choices of ours (tiles, warps, stages, splits) are turboquant_vllm.ops.attention.launch's.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from turboquant_vllm.bench import Batch, Shape, copy_bandwidth, flash, measure, ours, table, time_graph
from turboquant_vllm.core.layout import CacheLayout
from turboquant_vllm.core.presets import get_preset
from turboquant_vllm.ops import store_kv

from . import common

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
SHAPES = [(64, 8192), (32, 32768), (8, 131072), (1, 131072)]
NAME = "decode_kernel"


def default_stem(shapes: list[tuple[int, int]], gpu: str | None = None) -> Path:
    """benchmarks/results/decode_kernel/<gpu>-32q8kv-<batch>x<context>...: one file set per GPU and shape list."""
    what = f"{Q_HEADS}q{KV_HEADS}kv-" + "-".join(common.shape_tag(b, c) for b, c in shapes)
    return common.result_stem(NAME, what, gpu)


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


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--shapes", default=",".join(f"{b}x{c}" for b, c in SHAPES), help="BATCHxCONTEXT,...")
    ap.add_argument("--kernels", help="the kernels to time, ','-separated (default: all)")
    common.add_out_argument(ap, "benchmarks/results/decode_kernel/<gpu>-32q8kv-<shapes>")
    args = ap.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    command = common.command_line(NAME, argv)
    gen = torch.Generator().manual_seed(0)
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
            "tq4-cal": functools.partial(ours, b, "tq4", calibrated=True),
            "turboquant_4bit_nc": functools.partial(in_tree, b, "turboquant_4bit_nc"),
            "turboquant_3bit_nc": functools.partial(in_tree, b, "turboquant_3bit_nc"),
        }
        if args.kernels:
            kernels = {name: kernels[name] for name in args.kernels.split(",")}
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
    write(rows, peak, common.stem_of(args.out) if args.out else default_stem(shapes), common.provenance(command))


def write(rows, peak, stem: Path, provenance: dict) -> None:
    """stem.json (meta + rows), stem.md (the table), stem.png (time per kernel and shape)."""
    meta = dict(device=provenance["gpu"], copy_bandwidth_tbps=peak / 1e12, q_heads=Q_HEADS, kv_heads=KV_HEADS,
                head_dim=HEAD_DIM, block_size=BLOCK)
    common.write_json(common.with_ext(stem, ".json"), dict(meta=meta, rows=rows), provenance)
    lines = [f"Decode attention, {Q_HEADS} q / {KV_HEADS} KV heads, d={HEAD_DIM}, block {BLOCK}, "
             f"{meta['device']}, copy bandwidth {peak / 1e12:.2f} TB/s\n", *table(rows)]
    common.write_markdown(common.with_ext(stem, ".md"), "\n".join(lines) + "\n", provenance)
    print("\n".join(lines))
    kernels = [k for k in dict.fromkeys(r["kernel"] for r in rows) if k != "tq4_store"]
    shapes = list(dict.fromkeys((r["batch"], r["context"]) for r in rows))
    common.grouped_bars(common.with_ext(stem, ".png"), rows, kernels, "kernel", shapes,
                        lambda r: (r["batch"], r["context"]), [f"{b} x {c // 1024}k" for b, c in shapes],
                        "decode attention time (ms, lower is better)", f"Decode attention on {meta['device']}",
                        (10, 4.5))


if __name__ == "__main__":
    main()
