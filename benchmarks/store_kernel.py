"""Time the store kernel (kernels.store.store_kv: rotate, quantize, pack, scatter K and V) on the GPU for decode- and
prefill-sized batches and several launch configurations, CUDA-graph replay.

    python benchmarks/store_kernel.py [block_t,num_warps ...]     # e.g. 16,8 32,8 64,8 64,4 128,8
    HEAD_DIM=256 python benchmarks/store_kernel.py ...            # another head dimension

Shape: 4 KV heads, d 128 (the e2e model) unless HEAD_DIM says otherwise, tq4; the policy row is what store_kv
chooses itself.
"""

from __future__ import annotations

import os
import sys

import torch
import triton

from turboquant_vllm.core.layout import CacheLayout
from turboquant_vllm.core.presets import get_preset
from turboquant_vllm.kernels import store_kv
from turboquant_vllm.kernels.store import store_block_tokens

KV_HEADS, HEAD_DIM, BLOCK = 4, int(os.environ.get("HEAD_DIM", 128)), 16


def main() -> None:
    configs = {"policy": {}}
    for spec in sys.argv[1:]:
        block_t, warps = map(int, spec.split(","))
        configs[f"{block_t}x{warps}w"] = {"block_t": block_t, "num_warps": warps}
    layout = CacheLayout(get_preset("tq4"), HEAD_DIM, KV_HEADS, BLOCK)
    print(f"store_kv on {torch.cuda.get_device_name()}: {KV_HEADS} KV heads, d {HEAD_DIM}, tq4")
    print("| tokens | config | time (us) | GB/s (bf16 in + cache out) |")
    print("| --- | --- | --- | --- |")
    for tokens in (64, 1024, 2048, 4096, 8192, 16384):
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
        v = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
        cache = torch.zeros(layout.cache_shape(tokens // BLOCK + 1), dtype=torch.uint8, device="cuda")
        slots = torch.randperm(tokens, device="cuda", generator=gen)
        ref = None
        for name, kw in configs.items():
            store_kv(k, v, cache, slots, layout, **kw)
            torch.cuda.synchronize()
            ref = cache.clone() if ref is None else ref
            same = torch.equal(cache, ref)  # every configuration writes the same bytes
            us = triton.testing.do_bench_cudagraph(lambda kw=kw: store_kv(k, v, cache, slots, layout, **kw)) * 1e3
            moved = 2 * k.numel() * 2 + tokens * KV_HEADS * layout.bytes_per_token_per_head
            label = f"{name} ({store_block_tokens(tokens, HEAD_DIM)}x8w)" if name == "policy" else name
            print(f"| {tokens} | {label} | {us:.1f} | {moved / us / 1e3:.0f} |{'' if same else ' DIFFERENT BYTES'}",
                  flush=True)


if __name__ == "__main__":
    main()
