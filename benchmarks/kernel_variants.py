"""Time decode-kernel versions side by side on the GPU: each source tree x launch configurations, CUDA-graph replay,
plus the relative error against core.reference on 2 sequences (one with a ragged tail).

    git archive <commit> src | tar -x -C build/base       # one tree per version to compare
    python benchmarks/kernel_variants.py build/base [name=warps,block_n,maxnreg[,stages[,splits]]] ...]  # maxnreg 0:
                                                          # no cap; splits 0: the policy's
    MORE=1 python benchmarks/kernel_variants.py ...       # also k4v3, tq3 and tq4 at head_dim 256 / 64
    PRESETS=tq3,k5v4 python benchmarks/kernel_variants.py ...  # also these presets at 16 / 4, 64 x 8k and 32 x 32k
    BASE=0 ...                                            # without the three tq4 d 128 shapes
    SHAPES="16,4,1024,8192;..." ...                       # q heads, KV heads, batch, context instead of those three

Shapes: 16 q / 4 KV heads at 64 x 8k and 32 x 32k, 32 / 8 at 64 x 8k (d 128); value norms spread over 4x.
"""

from __future__ import annotations

import os
import sys

TREE = sys.argv[1]
sys.path.insert(0, os.path.join(TREE, "src"))  # the version under test, ahead of any installed one

import torch  # noqa: E402
import triton  # noqa: E402

import turboquant_vllm  # noqa: E402
from turboquant_vllm.core.layout import CacheLayout  # noqa: E402
from turboquant_vllm.core.presets import get_preset  # noqa: E402
from turboquant_vllm.core.reference import paged_attention_reference  # noqa: E402
from turboquant_vllm.kernels import paged_attention, store_kv  # noqa: E402
from turboquant_vllm.kernels import attention as kernels_attention  # noqa: E402
from turboquant_vllm.kernels.attention import attention_workspace_shape, default_num_splits  # noqa: E402

BLOCK = 16
TAG = os.path.basename(TREE.rstrip("/"))


def configs(specs: list[str]) -> dict[str, dict]:
    out = {"policy": {}}  # the launch paged_attention chooses itself
    for spec in specs:
        name, values = spec.split("=")
        warps, block_n, regs, *rest = map(int, values.split(","))
        stages, splits = rest + [3, 0][len(rest):]  # defaults: 3 stages, the policy's splits
        out[name] = {"num_warps": warps, "block_n": block_n, "max_registers": regs, "num_stages": stages,
                     **({"num_splits": splits} if splits else {})}
    return out


def run(variants: dict[str, dict], q_heads: int, kv_heads: int, batch: int, ctx: int, preset="tq4", head_dim=128):
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_blocks = batch * ctx // BLOCK
    layout = CacheLayout(get_preset(preset), head_dim, kv_heads, BLOCK)
    cache = torch.empty(layout.cache_shape(num_blocks), dtype=torch.uint8, device="cuda")
    for b0 in range(0, num_blocks, 4096):
        ids = torch.arange(b0, min(b0 + 4096, num_blocks), device="cuda")
        shape = (len(ids) * BLOCK, kv_heads, head_dim)
        k = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
        v = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
        v = v * torch.rand(shape[0], kv_heads, 1, device="cuda", generator=gen, dtype=torch.bfloat16) * 4
        store_kv(k, v, cache, (ids[:, None] * BLOCK + torch.arange(BLOCK, device="cuda")).flatten(), layout)
    table = torch.randperm(num_blocks, device="cuda", generator=gen).view(batch, -1).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    seq_lens[1] = ctx - 37  # a ragged tail
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    q = (torch.randn(batch, q_heads, head_dim, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    out = torch.empty_like(q)
    if hasattr(kernels_attention, "decode_launch"):
        splits = default_num_splits(batch, kv_heads,
                                    programs_per_sm=kernels_attention.decode_launch(layout.preset, head_dim).programs_per_sm)
    elif hasattr(kernels_attention, "per_warp_decode"):  # session 12's tree
        splits = default_num_splits(batch, kv_heads, per_warp=kernels_attention.per_warp_decode(layout.preset))
    else:  # before session 12: one policy for both kernels
        splits = default_num_splits(batch, kv_heads)
    q2, lens2 = q[:2], seq_lens[:2].clamp(max=3000)
    ref = paged_attention_reference(q2, cache, layout, table, qsl[:3], lens2, head_dim**-0.5)
    shape_name = f"{TAG:8s} {preset} d{head_dim} {q_heads}/{kv_heads} {batch}x{ctx}"
    for name, kw in variants.items():
        kw = {"num_splits": splits, **kw}
        ws = torch.empty(attention_workspace_shape(batch, q_heads, head_dim, kw["num_splits"]), dtype=torch.float32,
                         device="cuda")

        def step(kw=kw, ws=ws):
            paged_attention(q, cache, layout, table, qsl, seq_lens, max_query_len=1, scale=head_dim**-0.5, out=out,
                            workspace=ws, **kw)
        try:
            step()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench_cudagraph(step, rep=200)
        except (RuntimeError, triton.CompilationError) as e:  # a launch the GPU cannot run is a result too
            print(f"{shape_name} {name}: failed {e!r}"[:300], flush=True)
            continue
        o = torch.full_like(q2, float("nan"))
        paged_attention(q2, cache, layout, table, qsl[:3], lens2, max_query_len=1, scale=head_dim**-0.5, out=o, **kw)
        err = ((o.float() - ref).norm() / ref.norm()).item()
        gbs = batch * ctx * kv_heads * layout.bytes_per_token_per_head / ms / 1e6
        print(f"{shape_name} {name:10s}: {ms:.4f} ms {gbs:6.0f} GB/s err {err:.2e} nan={o.isnan().any().item()}",
              flush=True)


def main() -> None:
    assert turboquant_vllm.__file__.startswith(os.path.abspath(TREE)), turboquant_vllm.__file__
    variants = configs(sys.argv[2:])
    print(torch.cuda.get_device_name(), TAG)
    shapes = [(16, 4, 64, 8192), (16, 4, 32, 32768), (32, 8, 64, 8192)]
    if os.environ.get("SHAPES"):
        shapes = [tuple(int(x) for x in s.split(",")) for s in os.environ["SHAPES"].split(";")]
    for q_heads, kv_heads, batch, ctx in shapes if os.environ.get("BASE", "1") != "0" else []:
        run(variants, q_heads, kv_heads, batch, ctx)
        torch.cuda.empty_cache()
    if os.environ.get("MORE"):
        for preset in ("k4v3", "tq3"):
            run(variants, 16, 4, 64, 8192, preset)
        for head_dim in (256, 64):
            run(variants, 16, 4, 64, 8192, "tq4", head_dim)
    for preset in filter(None, os.environ.get("PRESETS", "").split(",")):
        for batch, ctx in [(64, 8192), (32, 32768)]:
            run(variants, 16, 4, batch, ctx, preset)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
