"""Decode attention over the model shapes users run: tq4 vs FlashAttention-3 bf16 and fp8 of the same contents for
every query-head group (1-8, 16), head_dim (64, 96, 128, 256) and batch x context point (1 x 8k .. 256 x 4k).

Each point builds one random bf16 cache (kv_heads KV heads, block 16, pages shuffled), stores it as tq4 and casts
it to fp8; every kernel is captured in a CUDA graph and timed by replay (median of 10 replays of ~20 ms each), after
a warm-up run, so no compile and no launch overhead sits in a timed window. Ours = query rotation + decode + merge
of the splits; FA3 = one kernel. `ours_served_ms`: decode + merge alone, as vLLM runs them (its store launch rotates
the queries with the step's keys; neither side's cache write is timed). Where the launch policy caps the split count
below what would give every SM its programs (one sequence, few KV heads), the uncapped counts are timed too
(`ours_ms_by_splits`).
Kernels compile first in --compile-workers processes (the Triton cache is shared), so compiling ~150 variants does
not serialize in front of the timing.

    python -m benchmarks decode_sweep [--groups 1,2,3,4,5,6,7,8,16] [--head-dims 64,96,128,256]
        [--points 1x8192,...] [--kv-heads 8] [--merge] [--time-budget S] [--out PATH]
    python -m benchmarks decode_sweep --report benchmarks/results/decode_sweep.json   # print its table on a CPU
        [--e2e benchmarks/results/e2e/h100-qwen2.5-7b-16x2k-64x8k.json,...]   # + end-to-end rows of `e2e --shape`
        [--out PATH]   # and write PATH.{json,md,png}; without it the result file is only read

Writes benchmarks/results/decode_sweep.{json,md,png}: {"points": [{"group", "head_dim", "batch", "context",
"bf16_kv_bytes", "ours_ms", "bf16_ms", "fp8_ms", ...}], "e2e": [...]}, a heat map of bf16 / ours per head_dim, and
the targets: >= 1.0x FA3 bf16 everywhere, >= 1.5x where bf16's KV read of one layer exceeds 256 MB.
"""

from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from . import common

NAME = "decode_sweep"
GROUPS = (1, 2, 3, 4, 5, 6, 7, 8, 16)
HEAD_DIMS = (64, 96, 128, 256)
POINTS = ((1, 8192), (1, 32768), (1, 131072), (8, 32768), (16, 2048), (32, 8192), (64, 8192), (256, 1024),
          (256, 4096))
KV_HEADS = 8
PRESET = "tq4"
BIG_READ = 256 * 1024**2  # bf16 KV bytes of one layer above which the target is 1.5x
DEFAULT_STEM = common.RESULTS / NAME
TIMING_REP_MS = 20
MAX_SPLIT_CANDIDATE = 128


def parse_points(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in p.split("x")) for p in text.split(",") if p]


def bf16_kv_bytes(batch: int, context: int, kv_heads: int, head_dim: int) -> int:
    """What FA3 bf16 reads for the keys and values of one layer."""
    return batch * context * kv_heads * head_dim * 2 * 2


def split_candidates(batch: int, kv_heads: int, sms: int, programs_per_sm: int, policy_splits: int,
                     most: int = MAX_SPLIT_CANDIDATE) -> list[int]:
    """Split counts above the policy's, up to the one that gives every SM programs_per_sm programs uncapped, at most
    `most` (256 and 512 splits took 5-10x the time of 64 at d 256): empty where the policy is not capped."""
    want = 2 ** math.ceil(math.log2(max(1.0, programs_per_sm * sms / max(1, batch * kv_heads))))
    want = min(want, most)
    out, s = [], policy_splits * 2
    while s <= want:
        out.append(s)
        s *= 2
    return out


def configs(groups, head_dims, points) -> list[tuple[int, int, int, int]]:
    """(group, head_dim, batch, context) in sweep order."""
    return [(g, d, b, c) for d in head_dims for g in groups for b, c in points]


# ---- GPU side ------------------------------------------------------------------------------------

def _compile_one(job: tuple[int, int, int, int, list[int]]) -> str:
    """In a worker process: run ours once at a short context with the sweep's constants (splits included), so the
    Triton cache holds every variant before timing starts."""
    import torch

    from turboquant_vllm.bench import Batch, Shape, ours

    group, head_dim, batch, kv_heads, splits = job
    gen = torch.Generator().manual_seed(0)
    context = 4096 if batch < 64 else 64  # every split gets tokens; a few MB per worker
    try:
        b = Batch(Shape(batch, context, group * kv_heads, kv_heads, head_dim), gen)
        for s in [None, *splits]:
            fn, _ = ours(b, PRESET, splits=s)
            fn()
        torch.cuda.synchronize()
    except Exception as e:  # the timing pass compiles (and reports) what failed here
        return f"{group}/{head_dim}/{batch}: {type(e).__name__}: {str(e)[:160]}"
    return ""


def measure_point(group: int, head_dim: int, batch: int, context: int, kv_heads: int, gen, policy: int,
                  extra: list[int]) -> dict:
    """One point: FA3 bf16 and fp8, ours at the policy's split count, and at the extra split counts."""
    import torch

    from turboquant_vllm.bench import Batch, Shape, flash, ours
    from turboquant_vllm.core.layout import CacheLayout
    from turboquant_vllm.core.presets import get_preset

    shape = Shape(batch, context, group * kv_heads, kv_heads, head_dim)
    b = Batch(shape, gen)
    layout = CacheLayout(get_preset(PRESET), head_dim, kv_heads, 16)
    row = dict(group=group, head_dim=head_dim, batch=batch, context=context, q_heads=group * kv_heads,
               kv_heads=kv_heads, bf16_kv_bytes=bf16_kv_bytes(batch, context, kv_heads, head_dim),
               ours_kv_bytes=batch * context * kv_heads * layout.bytes_per_token_per_head, splits=policy)

    def timed(make):  # do_bench_cudagraph runs fn once before it captures: compiles stay out of the timing
        return common.time_ms(make()[0], rep=TIMING_REP_MS)

    row["bf16_ms"] = timed(lambda: flash(b, False))
    row["fp8_ms"] = timed(lambda: flash(b, True))
    torch.cuda.empty_cache()
    row["ours_ms"] = timed(lambda: ours(b, PRESET))
    row["ours_served_ms"] = timed(lambda: ours(b, PRESET, served=True))
    if extra:
        row["ours_ms_by_splits"] = {str(s): timed(lambda s=s: ours(b, PRESET, splits=s)) for s in extra}
    return row


def run(args) -> dict:
    import torch

    from turboquant_vllm.bench import flash_available
    from turboquant_vllm.core.layout import CacheLayout
    from turboquant_vllm.core.presets import get_preset
    from turboquant_vllm.ops.attention import decode_launch, decode_num_splits, num_sms

    why = flash_available()
    if why:
        raise SystemExit(f"decode_sweep needs vLLM's FlashAttention-3: {why}")
    started = time.monotonic()
    sms = num_sms()
    todo = configs(args.groups, args.head_dims, args.points)
    splits = {}  # (group, head_dim, batch) -> (the policy's split count, the extra ones timed)
    jobs = {}
    for g, d, b, _ in todo:
        layout = CacheLayout(get_preset(PRESET), d, args.kv_heads, 16)
        policy = decode_num_splits(b, layout, sms)
        extra = split_candidates(b, args.kv_heads, sms, decode_launch(layout.preset, d).programs_per_sm, policy,
                                 args.max_probe_splits)
        splits[(g, d, b)] = (policy, extra)
        jobs[(g, d, b)] = (g, d, b, args.kv_heads, extra)
    if args.compile_workers > 0:
        import multiprocessing

        with ProcessPoolExecutor(args.compile_workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for failed in filter(None, pool.map(_compile_one, jobs.values())):
                print(f"compile pass: {failed}", flush=True)
        print(f"compiled {len(jobs)} launch sets in {time.monotonic() - started:.0f} s", flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for g, d, b, c in todo:
        if args.time_budget and time.monotonic() - started > args.time_budget:
            print(f"time budget of {args.time_budget} s spent: stopped before {g}/{d} {b}x{c}", flush=True)
            break
        try:
            row = measure_point(g, d, b, c, args.kv_heads, gen, *splits[(g, d, b)])
        except Exception as e:  # logged and left out, never hidden
            print(f"group {g} d {d} {b}x{c}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            torch.cuda.empty_cache()
            continue
        torch.cuda.empty_cache()
        rows.append(row)
        by = row.get("ours_ms_by_splits", {})
        print(f"group {g:2d} d {d:3d} {b:3d} x {c:6d}: bf16 {row['bf16_ms']:.4f} fp8 {row['fp8_ms']:.4f} "
              f"ours {row['ours_ms']:.4f} ms ({row['bf16_ms'] / row['ours_ms']:.2f}x, {row['splits']} splits)"
              + "".join(f"; {s} splits {ms:.4f}" for s, ms in by.items()), flush=True)
    return dict(meta=dict(preset=PRESET, block_size=16, kv_heads=args.kv_heads, sms=sms,
                          timing=f"CUDA-graph replay, median of 10 x {TIMING_REP_MS} ms"), points=rows, e2e=[])


# ---- results ------------------------------------------------------------------------------------

def point_key(p: dict) -> tuple:
    return (p["group"], p["head_dim"], p["batch"], p["context"], p["kv_heads"])


def merge(old: dict, new: dict) -> dict:
    """new's points replace old's at the same (group, head_dim, batch, context, kv_heads); the rest stay; e2e rows
    are kept."""
    points = {point_key(p): p for p in old.get("points", [])}
    points.update({point_key(p): p for p in new["points"]})
    order = {k: i for i, k in enumerate(point_key(dict(group=g, head_dim=d, batch=b, context=c,
                                                        kv_heads=new["meta"]["kv_heads"]))
                                        for g, d, b, c in configs(GROUPS, HEAD_DIMS, POINTS))}
    merged = sorted(points.values(), key=lambda p: (order.get(point_key(p), len(order)), point_key(p)))
    return dict(new, points=merged, e2e=new.get("e2e") or old.get("e2e", []))


def e2e_rows(path: Path) -> list[dict]:
    """{"shape", "ours_tok_s", "bf16_tok_s"} per decode run of an e2e result holding both a tq4 and a bf16 row."""
    doc = json.loads(Path(path).read_text())
    by_kv = {r["kv"]: r for r in doc["rows"]}
    if "tq4" not in by_kv or "bf16" not in by_kv:
        return []
    name = doc["meta"].get("shape") or Path(path).stem
    out = []
    for key, ours in by_kv["tq4"].items():
        bf16 = by_kv["bf16"].get(key)
        if key.startswith("decode_tok_s_") and ours and bf16:
            out.append({"shape": f"{name} {key.removeprefix('decode_tok_s_')}", "ours_tok_s": ours, "bf16_tok_s": bf16,
                        "source": str(path)})
    return out


def speedup(p: dict, key: str = "ours_ms") -> float:
    return p["bf16_ms"] / p[key]


def where(ps: list[dict], key: str = "ours_ms") -> str:
    """The points as "g<group> d<head_dim> <batch>x<context> <speed-up>x", the first 12."""
    return ", ".join(f"g{p['group']} d{p['head_dim']} {common.shape_tag(p['batch'], p['context'])} "
                     f"{speedup(p, key):.2f}x" for p in ps[:12]) + (f" (+{len(ps) - 12} more)" if len(ps) > 12 else "")


def best_split(p: dict) -> tuple[str, float]:
    """(split count, ms) of the fastest split count timed at this point, the policy's included."""
    times = {str(p["splits"]): p["ours_ms"], **p.get("ours_ms_by_splits", {})}
    s = min(times, key=times.get)
    return s, times[s]


def targets(points: list[dict]) -> list[str]:
    lines = ["| target | result | measured |", "| --- | --- | --- |"]
    if not points:
        return lines
    slow = [p for p in points if speedup(p) < 1.0]
    big = [p for p in points if p["bf16_kv_bytes"] > BIG_READ]
    big_slow = [p for p in big if speedup(p) < 1.5]
    worst = min(points, key=speedup)

    lines.append(f"| >= 1.0x FA3 bf16 at every point | {'PASS' if not slow else 'FAIL'} | "
                 f"{len(points) - len(slow)} of {len(points)} points; lowest {speedup(worst):.2f}x "
                 f"(g{worst['group']} d{worst['head_dim']} {common.shape_tag(worst['batch'], worst['context'])})"
                 f"{'; below: ' + where(slow) if slow else ''} |")
    lines.append(f"| >= 1.5x where bf16 reads > 256 MB a layer | {'PASS' if big and not big_slow else 'FAIL'} | "
                 f"{len(big) - len(big_slow)} of {len(big)} points"
                 f"{'; below: ' + where(big_slow) if big_slow else ''} |")
    return lines


def markdown(doc: dict) -> str:
    points = doc["points"]
    meta = doc["meta"]
    out = [f"## Decode attention sweep: {meta.get('preset', PRESET)} / FA3 bf16 (speed-up, higher is better)\n",
           f"{meta.get('gpu')}, {meta.get('kv_heads')} KV heads (query heads = group x KV heads), block "
           f"{meta.get('block_size')}, {meta.get('timing')}. Ours: query rotation + decode + split merge.\n",
           *targets(points)]
    if doc.get("e2e"):
        slow = [r for r in doc["e2e"] if r["ours_tok_s"] < r["bf16_tok_s"]]
        out.append(f"| end to end >= 1.0x bf16 for every model shape | {'PASS' if not slow else 'FAIL'} | "
                   f"{len(doc['e2e']) - len(slow)} of {len(doc['e2e'])} runs"
                   + "".join(f"; {r['shape']} {r['ours_tok_s'] / r['bf16_tok_s']:.2f}x" for r in slow) + " |")
    out.append("")
    served = [p for p in points if p.get("ours_served_ms")]
    if served:
        below = [p for p in served if p["ours_served_ms"] > p["bf16_ms"]]
        out += [f"As served (decode + merge; vLLM's store launch rotates the queries): {len(served) - len(below)} of "
                f"{len(served)} points measured so >= 1.0x FA3 bf16"
                + (f"; below: {where(below, 'ours_served_ms')}" if below else "") + ".", ""]
    if meta.get("commands"):
        out += ["Measured by, merged in this order:", ""]
        commits = meta.get("commits") or [None] * len(meta["commands"])
        out += [f"- `{c}` at {k}" for c, k in zip(meta["commands"], commits)]
        out.append("")
    for d in sorted({p["head_dim"] for p in points}):
        ps = [p for p in points if p["head_dim"] == d]
        shapes = list(dict.fromkeys((p["batch"], p["context"]) for p in ps))
        out += [f"### head_dim {d}\n", "| group | " + " | ".join(common.shape_tag(b, c) for b, c in shapes) + " |",
                "| --- |" + " --- |" * len(shapes)]
        for g in sorted({p["group"] for p in ps}):
            cells = []
            for b, c in shapes:
                p = next((p for p in ps if p["group"] == g and (p["batch"], p["context"]) == (b, c)), None)
                if p is None:
                    cells.append("")
                    continue
                cell = f"{speedup(p):.2f}x"
                s, ms = best_split(p)
                if s != str(p["splits"]):
                    cell += f" ({p['bf16_ms'] / ms:.2f}x at {s} splits)"
                cells.append(cell)
            out.append(f"| {g} | " + " | ".join(cells) + " |")
        out.append("")
    out += ["### times (ms)\n",
            "| group | head_dim | batch x context | bf16 KV MB | FA3 bf16 | FA3 fp8 | ours | ours / bf16 bytes "
            "| splits | ours at more splits |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in points:
        more = ", ".join(f"{s}: {ms:.4f}" for s, ms in p.get("ours_ms_by_splits", {}).items())
        out.append(f"| {p['group']} | {p['head_dim']} | {p['batch']} x {p['context']} | "
                   f"{p['bf16_kv_bytes'] / 1e6:.0f} | {p['bf16_ms']:.4f} | {p['fp8_ms']:.4f} | {p['ours_ms']:.4f} | "
                   f"{p['ours_kv_bytes'] / p['bf16_kv_bytes']:.3f} | {p['splits']} | {more} |")
    if doc.get("e2e"):
        out += ["", "### end to end (vLLM)\n", "| shape | ours tok/s | bf16 tok/s | ours / bf16 |",
                "| --- | --- | --- | --- |"]
        out += [f"| {r['shape']} | {r['ours_tok_s']:.1f} | {r['bf16_tok_s']:.1f} | "
                f"{r['ours_tok_s'] / r['bf16_tok_s']:.2f}x |" for r in doc["e2e"]]
    return "\n".join(out) + "\n"


def heatmap(path: Path, doc: dict) -> None:
    """One panel per head_dim: groups down, batch x context across, colour and label = bf16 / ours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    points = doc["points"]
    dims = sorted({p["head_dim"] for p in points})
    fig, axes = plt.subplots(1, len(dims), figsize=(5.2 * len(dims), 4.6), squeeze=False)
    norm = TwoSlopeNorm(vmin=0.5, vcenter=1.0, vmax=3.5)
    im = None
    for ax, d in zip(axes[0], dims):
        ps = [p for p in points if p["head_dim"] == d]
        shapes = list(dict.fromkeys((p["batch"], p["context"]) for p in ps))
        groups = sorted({p["group"] for p in ps})
        grid = [[math.nan] * len(shapes) for _ in groups]
        for p in ps:
            grid[groups.index(p["group"])][shapes.index((p["batch"], p["context"]))] = speedup(p)
        im = ax.imshow(grid, cmap="RdYlGn", norm=norm, aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6.5)
        ax.set_xticks(range(len(shapes)), [common.shape_tag(b, c) for b, c in shapes], rotation=60, fontsize=7)
        ax.set_yticks(range(len(groups)), groups, fontsize=7)
        ax.set_xlabel("batch x context")
        ax.set_ylabel("query heads per KV head")
        ax.set_title(f"head_dim {d}")
    fig.suptitle(f"{doc['meta'].get('preset', PRESET)} decode / FA3 bf16 on {doc['meta'].get('gpu')} "
                 f"({doc['meta'].get('kv_heads')} KV heads)")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="speed-up vs FA3 bf16")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def with_e2e(doc: dict, paths: list[Path]) -> dict:
    new = [r for p in paths for r in e2e_rows(p)]
    kept = [r for r in doc.get("e2e", []) if r["shape"] not in {n["shape"] for n in new}]
    return dict(doc, e2e=kept + new)


def write(doc: dict, stem: Path) -> None:
    meta = {k: v for k, v in doc["meta"].items()}
    common.write_json(common.with_ext(stem, ".json"), doc, meta)
    common.write_markdown(common.with_ext(stem, ".md"), markdown(doc), meta)
    if doc["points"]:
        heatmap(common.with_ext(stem, ".png"), doc)


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(NAME, __doc__)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--groups", type=ints, default=list(GROUPS))
    ap.add_argument("--head-dims", type=ints, default=list(HEAD_DIMS))
    ap.add_argument("--points", type=parse_points, default=list(POINTS), help="BATCHxCONTEXT,...")
    ap.add_argument("--kv-heads", type=int, default=KV_HEADS)
    ap.add_argument("--compile-workers", type=int, default=min(8, os.cpu_count() or 1),
                    help="processes that compile the kernels first (0: compile while timing)")
    ap.add_argument("--max-probe-splits", type=int, default=MAX_SPLIT_CANDIDATE,
                    help="largest split count timed beside the policy's (the policy's own count: none)")
    ap.add_argument("--time-budget", type=float, default=0, help="seconds; stop starting points after it (0: none)")
    ap.add_argument("--merge", action="store_true", help="keep the points of the existing result not measured now")
    ap.add_argument("--report", type=Path, help="print this result JSON's table (no GPU; the file is only read; "
                    "--out writes the rendered JSON, Markdown and heat map)")
    ap.add_argument("--e2e", type=lambda s: [Path(x) for x in s.split(",")], default=[],
                    help="e2e result JSONs (python -m benchmarks e2e --shape ...) whose tq4 / bf16 rows become the "
                    "end-to-end rows (replacing those of the same shape and run)")
    common.add_out_argument(ap, "benchmarks/results/decode_sweep")
    args = ap.parse_args(argv)
    if args.report:
        doc = with_e2e(json.loads(args.report.read_text()), args.e2e)
        print(common.markdown_header(doc["meta"]) + markdown(doc), end="")
        if args.out:
            write(doc, common.stem_of(args.out))
        return
    stem = common.stem_of(args.out) if args.out else DEFAULT_STEM
    command = common.command_line(NAME, argv)
    doc = run(args)
    doc["meta"] = {**common.provenance(command), **doc["meta"]}
    old = common.with_ext(stem, ".json")
    if args.merge and old.exists():
        prev = json.loads(old.read_text())
        commands = prev["meta"].get("commands") or [prev["meta"].get("command")]
        commits = prev["meta"].get("commits") or [prev["meta"].get("commit")]
        doc = merge(prev, doc)
        doc["meta"].update(commands=[*commands, command], commits=[*commits, doc["meta"]["commit"]])
    write(with_e2e(doc, args.e2e), stem)
    print(markdown(doc))


if __name__ == "__main__":
    main()
