"""turboquant-vllm: verify the math, demo and bench the kernels, serve a model with the compressed KV cache."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys


def cmd_verify(args: argparse.Namespace) -> int:
    from .core.presets import PRESETS
    from .core.selftest import distortion_table

    table = distortion_table(dim=args.head_dim, num_vectors=args.vectors)
    presets = [
        {"name": p.name, "head_dim": args.head_dim, "bytes_per_token_per_head": p.bytes_per_token_per_head(args.head_dim),
         "capacity_vs_bf16": round(p.capacity_vs_bf16(args.head_dim), 4), "summary": p.summary}
        for p in PRESETS.values()
    ]
    ok = all(abs(r["mse"] / r["lloyd_max"] - 1) < 0.02 and r["mse"] > r["bound"] for r in table)
    if args.json:
        print(json.dumps({"head_dim": args.head_dim, "distortion": table, "presets": presets, "ok": ok}, indent=1))
        return 0 if ok else 1
    print(f"TurboQuant-MSE distortion E||x - x_hat||^2 over {args.vectors} random unit vectors, d = {args.head_dim}")
    print(f"{'bits':>4} {'measured':>10} {'optimum':>10} {'ratio':>7} {'gauss lim':>10} {'bound 4^-b':>11}")
    for r in table:
        print(f"{r['bits']:>4} {r['mse']:>10.5f} {r['lloyd_max']:>10.5f} {r['mse'] / r['lloyd_max']:>7.3f} "
              f"{r['gaussian_limit']:>10.5f} {r['bound']:>11.5f}")
    print(f"\npresets at head_dim {args.head_dim} (bf16: {4 * args.head_dim} B per token per KV head)")
    for p in presets:
        print(f"  {p['name']:5s} {p['bytes_per_token_per_head']:4d} B  {p['capacity_vs_bf16']:.2f}x  {p['summary']}")
    print("\nverify:", "ok (every bit width within 2% of its optimum, above the bound)" if ok else "FAILED")
    return 0 if ok else 1


def cmd_demo(args: argparse.Namespace) -> int:
    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import
    from .core.layout import CacheLayout
    from .core.presets import get_preset
    from .core.reference import paged_attention_reference, read_kv_reference
    from .kernels import paged_attention, store_kv

    device = "cuda" if on_gpu else "cpu"
    gen = torch.Generator().manual_seed(0)
    d, kv_heads, q_heads, bs = args.head_dim, 2, 8, 16
    seq_lens = [args.context, args.context // 2 + 1]
    layout = CacheLayout(get_preset(args.preset), d, kv_heads, bs)
    blocks = [math.ceil(n / bs) for n in seq_lens]
    table = torch.arange(sum(blocks), dtype=torch.int32).split(blocks)
    block_table = torch.nn.utils.rnn.pad_sequence(list(table), batch_first=True).to(device)
    cache = torch.zeros(layout.cache_shape(sum(blocks)), dtype=torch.uint8, device=device)
    keys = torch.randn(sum(seq_lens), kv_heads, d, generator=gen).to(torch.bfloat16).to(device)
    values = torch.randn(sum(seq_lens), kv_heads, d, generator=gen).to(torch.bfloat16).to(device)
    slots = torch.cat([table[i].long().repeat_interleave(bs)[:n] * bs + torch.arange(n) % bs
                       for i, n in enumerate(seq_lens)]).to(device)
    store_kv(keys, values, cache, slots, layout)
    k_hat, v_hat = read_kv_reference(cache, block_table[0], seq_lens[0], layout)
    k_err = ((k_hat - keys[: seq_lens[0]].float()).norm() / keys[: seq_lens[0]].float().norm()).item()
    query = torch.randn(2, q_heads, d, generator=gen).to(torch.bfloat16).to(device)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = torch.empty_like(query)
    paged_attention(query, cache, layout, block_table, qsl, lens, max_query_len=1, scale=d**-0.5, out=out)
    ref = paged_attention_reference(query, cache, layout, block_table, qsl, lens, d**-0.5)
    att_err = ((out.float() - ref).norm() / ref.norm()).item()
    where = "GPU (native Triton kernels)" if on_gpu else "CPU (Triton interpreter)"
    print(f"turboquant-vllm demo on {where}: preset {layout.preset.name}, head_dim {d}, contexts {seq_lens}")
    print(f"  KV cache: {layout.bytes_per_token_per_head} B per token per KV head vs {4 * d} B bf16 "
          f"-> {layout.preset.capacity_vs_bf16(d):.2f}x compression")
    print(f"  key reconstruction relative error (quantization): {k_err:.4f}")
    print(f"  decode attention vs float32 reference over the same compressed cache: relative error {att_err:.2e}")
    return 0 if att_err < 1e-2 else 1


def cmd_bench(args: argparse.Namespace) -> int:
    import functools

    import torch

    from .core.presets import get_preset

    presets = args.presets.split(",")
    for p in presets:
        get_preset(p)  # an unknown name fails here, with the list of presets
    q_heads, kv_heads = args.heads
    if not torch.cuda.is_available():
        print("turboquant-vllm bench times the kernels natively and needs a CUDA GPU; none is visible here. "
              "`turboquant-vllm demo` runs them on a CPU (Triton's interpreter).", file=sys.stderr)
        return 2
    from .bench import Batch, Shape, copy_bandwidth, flash, flash_available, measure, ours, table

    peak = copy_bandwidth()
    no_flash = flash_available()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch, context in args.shapes:
        b = Batch(Shape(batch, context, q_heads, kv_heads, args.head_dim), gen)
        kernels = {} if no_flash else {"fa3_bf16": functools.partial(flash, b, False),
                                       "fa3_fp8": functools.partial(flash, b, True)}
        kernels.update({p: functools.partial(ours, b, p) for p in presets})
        rows += measure(b, kernels, peak, log=lambda line: print(line, file=sys.stderr))
        del b
        torch.cuda.empty_cache()
    device = torch.cuda.get_device_name()
    if args.json:
        print(json.dumps({"device": device, "copy_bandwidth_tbps": peak / 1e12, "baselines": no_flash or "ok",
                          "rows": rows}, indent=1))
        return 0 if rows else 1
    print(f"Decode attention on {device} (copy bandwidth {peak / 1e12:.2f} TB/s): {q_heads} query / {kv_heads} KV "
          f"heads, head_dim {args.head_dim}, one query token per sequence, CUDA-graph replay")
    if no_flash:
        print(f"FlashAttention baselines left out: {no_flash}")
    print("\n".join(table(rows)))
    for p in presets:
        preset = get_preset(p)
        print(f"{p}: {preset.bytes_per_token_per_head(args.head_dim)} B per token per KV head, "
              f"{preset.capacity_vs_bf16(args.head_dim):.2f}x the tokens of a bf16 cache")
    return 0 if rows else 1


def cmd_serve(args: argparse.Namespace, extra: list[str]) -> int:
    from .core.presets import get_preset

    preset = args.preset or os.environ.get("TURBOQUANT_PRESET") or "tq4"
    get_preset(preset)  # fail here, with the list of presets, not inside vLLM
    env = dict(os.environ, TURBOQUANT_PRESET=preset)
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model, "--attention-backend", "CUSTOM"]
    os.execvpe(cmd[0], cmd + extra, env)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from .core.presets import get_preset

    get_preset(args.preset)
    os.environ["TURBOQUANT_PRESET"] = args.preset
    from .vllm.calibrate import calibrate

    calibrate(args.model, args.text, args.out, max_tokens=args.tokens, window=args.window,
              gpu_memory_utilization=args.gpu_memory_utilization)
    print(f"serve with: TURBOQUANT_KEY_CALIBRATION={args.out} turboquant-vllm serve {args.model} --preset {args.preset}")
    return 0


def _int_pairs(sep: str, what: str):
    """argparse type: "AxB[,CxD...]" (sep "x") or "A/B" (sep "/") of positive integers, with a usage error otherwise."""
    def parse(text: str) -> list[tuple[int, int]] | tuple[int, int]:
        try:
            pairs = [tuple(int(x) for x in item.split(sep)) for item in text.split(",")]
            if any(len(p) != 2 or min(p) < 1 for p in pairs):
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        return pairs if sep == "x" else pairs[0]
    return parse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="turboquant-vllm", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="distortion self-test and preset byte layouts")
    v.add_argument("--json", action="store_true")
    v.add_argument("--head-dim", type=int, default=128)
    v.add_argument("--vectors", type=int, default=20000)
    d = sub.add_parser("demo", help="run the store and attention kernels once and report error and compression")
    d.add_argument("--preset", default="tq4")
    d.add_argument("--head-dim", type=int, default=128)
    d.add_argument("--context", type=int, default=200)
    b = sub.add_parser("bench", help="time decode attention on this GPU: presets vs FlashAttention-3 bf16 / fp8")
    b.add_argument("--presets", default="tq4", help="comma-separated presets")
    b.add_argument("--shapes", type=_int_pairs("x", "BATCHxCONTEXT[,BATCHxCONTEXT...], e.g. 64x8192"),
                   default="64x8192,32x32768", help="BATCHxCONTEXT,... (one query token per sequence)")
    b.add_argument("--heads", type=_int_pairs("/", "QUERY_HEADS/KV_HEADS, e.g. 32/8"), default="32/8",
                   help="query / KV heads")
    b.add_argument("--head-dim", type=int, default=128)
    b.add_argument("--json", action="store_true")
    s = sub.add_parser("serve", help="vllm serve MODEL --attention-backend CUSTOM with a preset (extra args go to vLLM)")
    s.add_argument("model")
    s.add_argument("--preset", help="default: $TURBOQUANT_PRESET, else tq4")
    c = sub.add_parser("calibrate", help="fit a key calibration (mean and scale per layer and KV head) on text")
    c.add_argument("model")
    c.add_argument("--text", nargs="+", required=True, help="text files or directories of *.txt")
    c.add_argument("--out", required=True, help="the .safetensors file to write")
    c.add_argument("--tokens", type=int, default=262_144, help="calibration tokens at most")
    c.add_argument("--window", type=int, default=2048, help="tokens per prompt")
    c.add_argument("--preset", default="tq4", help="the cache the calibration run stores into")
    c.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args, extra = ap.parse_known_args(argv)
    if args.command == "serve":
        return cmd_serve(args, extra)
    if extra:
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    return {"verify": cmd_verify, "demo": cmd_demo, "bench": cmd_bench, "calibrate": cmd_calibrate}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
