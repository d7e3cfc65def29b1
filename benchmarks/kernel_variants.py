"""Decode attention under launch variants side by side on the GPU: warps, block_n, register cap, pipeline stages and
split count against the launch policy's choice, CUDA-graph replay, plus the relative error against the PyTorch
reference (ops.attention.naive) on 2 sequences (one with a ragged tail).

    python -m benchmarks kernel_variants [NAME=WARPS,BLOCK_N,MAXNREG[,STAGES[,SPLITS[,MIN_SPLIT[,MERGE_ROWS
                                         [,HEAD_SPLIT]]]]]] ...]
        # MAXNREG 0: no cap; STAGES default 3; SPLITS 0: the policy's; MIN_SPLIT: least tokens a split, MERGE_ROWS:
        # rows a merge program takes (0: the policy's); HEAD_SPLIT: programs a KV head's query heads are dealt to
        [--shapes "16,4,64,8192;16,4,32,32768;32,8,64,8192"]   # q heads, KV heads, batch, context
        [--presets tq4] [--head-dims 128] [--out PATH]

Value norms spread over 4x. The "policy" row is what paged_attention launches by itself (ops.decode_launch,
ops.decode_num_splits). To compare versions of the kernels, run it in each tree (e.g. a `git worktree`): each
result records the commit it measured. Writes benchmarks/results/kernel_variants/<gpu>-<presets>-d<head dims>.{json,md}
(e.g. h200-tq4-d128).
"""

from __future__ import annotations

from pathlib import Path

import torch

from turboquant_vllm.core.layout import CacheLayout
from turboquant_vllm.core.presets import get_preset
from turboquant_vllm.ops import attention_workspace_shape, decode_num_splits, paged_attention, store_kv
from turboquant_vllm.ops.attention.naive import paged_attention_reference

from . import common

NAME = "kernel_variants"
BLOCK = 16
SHAPES = "16,4,64,8192;16,4,32,32768;32,8,64,8192"


def configs(specs: list[str]) -> dict[str, dict]:
    """NAME=WARPS,BLOCK_N,MAXNREG[,STAGES[,SPLITS[,MIN_SPLIT[,MERGE_ROWS[,HEAD_SPLIT]]]]] specs -> paged_attention
    options by name, after the policy's."""
    out: dict[str, dict] = {"policy": {}}  # the launch paged_attention chooses itself
    for spec in specs:
        name, values = spec.split("=")
        warps, block_n, regs, *rest = map(int, values.split(","))
        # 3 stages unless given; 0 (the policy's) for the rest
        stages, splits, min_split, merge_rows, head_split = rest + [3, 0, 0, 0, 0][len(rest):]
        out[name] = {"num_warps": warps, "block_n": block_n, "max_registers": regs, "num_stages": stages,
                     **({"num_splits": splits} if splits else {}),
                     **({"min_split_tokens": min_split} if min_split else {}),
                     **({"merge_rows": merge_rows} if merge_rows else {}),
                     **({"head_split": head_split} if head_split else {})}
    return out


def shapes_of(spec: str) -> list[tuple[int, int, int, int]]:
    """"Q,KV,BATCH,CONTEXT;..." -> (q heads, KV heads, batch, context) tuples."""
    return [tuple(int(x) for x in s.split(",")) for s in spec.split(";") if s]


def run(variants: dict[str, dict], q_heads: int, kv_heads: int, batch: int, ctx: int, preset: str,
        head_dim: int) -> list[dict]:
    """Every variant over one shape: its time, bandwidth and error (a launch that fails is a row with its error)."""
    import triton

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
    seq_lens[-1] = ctx - 37  # a ragged tail
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    q = (torch.randn(batch, q_heads, head_dim, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    out = torch.empty_like(q)
    splits = decode_num_splits(batch, layout)
    checked = min(batch, 2)  # sequences checked against the reference (the last one ragged)
    q2, lens2 = q[-checked:], seq_lens[-checked:].clamp(max=3000)
    ref = paged_attention_reference(q2, cache, layout, table[-checked:], qsl[:checked + 1], lens2, head_dim**-0.5)
    rows = []
    for name, kw in variants.items():
        kw = {"num_splits": splits, **kw}
        row = dict(variant=name, preset=preset, head_dim=head_dim, q_heads=q_heads, kv_heads=kv_heads, batch=batch,
                   context=ctx, options=kw)
        ws = torch.empty(attention_workspace_shape(batch, q_heads, head_dim, kw["num_splits"]), dtype=torch.float32,
                         device="cuda")

        def step(kw=kw, ws=ws):
            paged_attention(q, cache, layout, table, qsl, seq_lens, max_query_len=1, scale=head_dim**-0.5, out=out,
                            workspace=ws, **kw)
        try:
            step()
            torch.cuda.synchronize()
            ms = common.time_ms(step, rep=200)
        except (RuntimeError, triton.CompilationError) as e:  # a launch the GPU cannot run is a result too
            rows.append(dict(row, error=repr(e)[:300]))
            print(line(rows[-1]), flush=True)
            continue
        o = torch.full_like(q2, float("nan"))
        paged_attention(q2, cache, layout, table[-checked:], qsl[:checked + 1], lens2, max_query_len=1,
                        scale=head_dim**-0.5, out=o, **kw)
        rows.append(dict(row, time_ms=ms, gbps=batch * ctx * kv_heads * layout.bytes_per_token_per_head / ms / 1e6,
                         rel_error=((o.float() - ref).norm() / ref.norm()).item(), nan=o.isnan().any().item()))
        print(line(rows[-1]), flush=True)
    return rows


def line(r: dict) -> str:
    shape = f"{r['preset']} d{r['head_dim']} {r['q_heads']}/{r['kv_heads']} {r['batch']}x{r['context']}"
    if "error" in r:
        return f"| {shape} | {r['variant']} | failed: {r['error']} | | |"
    return (f"| {shape} | {r['variant']} | {r['time_ms']:.4f} | {r['gbps']:.0f} | {r['rel_error']:.2e}"
            f"{' NaN' if r['nan'] else ''} |")


def markdown(rows: list[dict], variants: dict[str, dict]) -> str:
    spec = "; ".join(f"{n}: {o}" for n, o in variants.items() if o)
    head = ["| shape | variant | time (ms) | GB/s | rel. error |", "| --- | --- | --- | --- | --- |"]
    return (f"Decode attention launch variants (policy: paged_attention's own choice{'; ' + spec if spec else ''})"
            "\n\n" + "\n".join(head + [line(r) for r in rows]) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("variants", nargs="*", metavar="NAME=WARPS,BLOCK_N,MAXNREG[,STAGES[,SPLITS[,...]]]")
    ap.add_argument("--shapes", default=SHAPES, help="Q,KV,BATCH,CONTEXT;... (q heads, KV heads, batch, context)")
    ap.add_argument("--presets", default="tq4")
    ap.add_argument("--head-dims", default="128")
    common.add_out_argument(ap, "benchmarks/results/kernel_variants/<gpu>-<presets>-d<head dims>")
    args = ap.parse_args(argv)
    provenance = common.provenance(common.command_line(NAME, argv))
    variants = configs(args.variants)
    print(f"{provenance['gpu']}, commit {provenance['commit']}", flush=True)
    rows = []
    for preset in args.presets.split(","):
        for head_dim in map(int, args.head_dims.split(",")):
            for q_heads, kv_heads, batch, ctx in shapes_of(args.shapes):
                rows += run(variants, q_heads, kv_heads, batch, ctx, preset, head_dim)
                torch.cuda.empty_cache()
    what = args.presets.replace(",", "-") + "-d" + args.head_dims.replace(",", "-")
    stem = common.stem_of(args.out) if args.out else common.result_stem(NAME, what)
    write(rows, variants, stem, dict(shapes=args.shapes, variants=variants), provenance)


def write(rows: list[dict], variants: dict[str, dict], stem: Path, meta: dict, provenance: dict) -> None:
    common.write_json(common.with_ext(stem, ".json"), dict(meta=meta, rows=rows), provenance)
    common.write_markdown(common.with_ext(stem, ".md"), markdown(rows, variants), provenance)


if __name__ == "__main__":
    main()
