"""Time the store kernel (turboquant_vllm.ops.store_kv: rotate, quantize, pack, scatter K and V) on the GPU for
decode- and prefill-sized batches and several launch configurations, CUDA-graph replay.

    python -m benchmarks store_kernel [BLOCK_T,NUM_WARPS ...] [--head-dim 128] [--preset tq4] [--out PATH]
    python -m benchmarks store_kernel 16,8 32,8 64,8 64,4 128,8
    python -m benchmarks store_kernel --head-dim 256 32,8 64,8

Shape: 4 KV heads (the e2e model), d --head-dim; the policy row is what store_kv chooses itself, every other row
must write the same bytes. Writes benchmarks/results/store_kernel/<gpu>-<preset>-d<head_dim>.{json,md}.
"""

from __future__ import annotations

from pathlib import Path

import torch

from turboquant_vllm.core.layout import CacheLayout
from turboquant_vllm.core.presets import get_preset
from turboquant_vllm.ops import store_kv
from turboquant_vllm.ops.store import store_block_tokens

from . import common

NAME = "store_kernel"
KV_HEADS, BLOCK = 4, 16
TOKENS = (64, 1024, 2048, 4096, 8192, 16384)


def configs(specs: list[str]) -> dict[str, dict]:
    """"BLOCK_T,NUM_WARPS" specs -> launch options by name, after the policy's (no options)."""
    out: dict[str, dict] = {"policy": {}}
    for spec in specs:
        block_t, warps = map(int, spec.split(","))
        out[f"{block_t}x{warps}w"] = {"block_t": block_t, "num_warps": warps}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("configs", nargs="*", metavar="BLOCK_T,NUM_WARPS", help="launch configurations besides the policy")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--preset", default="tq4")
    common.add_out_argument(ap, "benchmarks/results/store_kernel/<gpu>-<preset>-d<head_dim>")
    args = ap.parse_args(argv)
    provenance = common.provenance(common.command_line(NAME, argv))
    layout = CacheLayout(get_preset(args.preset), args.head_dim, KV_HEADS, BLOCK)
    rows = []
    print("\n".join(table(rows)), flush=True)
    for tokens in TOKENS:
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        k = torch.randn(tokens, KV_HEADS, args.head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
        v = torch.randn(tokens, KV_HEADS, args.head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
        cache = torch.zeros(layout.cache_shape(tokens // BLOCK + 1), dtype=torch.uint8, device="cuda")
        slots = torch.randperm(tokens, device="cuda", generator=gen)
        ref = None
        for name, kw in configs(args.configs).items():
            store_kv(k, v, cache, slots, layout, **kw)
            torch.cuda.synchronize()
            ref = cache.clone() if ref is None else ref
            us = common.time_ms(lambda kw=kw: store_kv(k, v, cache, slots, layout, **kw)) * 1e3
            moved = 2 * k.numel() * 2 + tokens * KV_HEADS * layout.bytes_per_token_per_head  # bf16 in + cache out
            label = f"{name} ({store_block_tokens(tokens, args.head_dim)}x8w)" if name == "policy" else name
            rows.append(dict(tokens=tokens, config=label, time_us=us, gbps=moved / us / 1e3,
                             same_bytes=torch.equal(cache, ref)))  # every configuration writes the same bytes
            print(table(rows[-1:])[-1], flush=True)
    stem = common.stem_of(args.out) if args.out else common.result_stem(NAME, f"{args.preset}-d{args.head_dim}")
    write(rows, stem, dict(preset=args.preset, kv_heads=KV_HEADS, head_dim=args.head_dim, block_size=BLOCK),
          provenance)


def table(rows: list[dict]) -> list[str]:
    lines = ["| tokens | config | time (us) | GB/s (bf16 in + cache out) |", "| --- | --- | --- | --- |"]
    return lines + [f"| {r['tokens']} | {r['config']} | {r['time_us']:.1f} | {r['gbps']:.0f} |"
                    f"{'' if r['same_bytes'] else ' DIFFERENT BYTES'}" for r in rows]


def write(rows: list[dict], stem: Path, meta: dict, provenance: dict) -> None:
    common.write_json(common.with_ext(stem, ".json"), dict(meta=meta, rows=rows), provenance)
    text = (f"store_kv, {meta['preset']}, {meta['kv_heads']} KV heads, d {meta['head_dim']}, "
            f"{provenance['gpu']}, CUDA-graph replay\n\n" + "\n".join(table(rows)) + "\n")
    common.write_markdown(common.with_ext(stem, ".md"), text, provenance)
    print(text)


if __name__ == "__main__":
    main()
