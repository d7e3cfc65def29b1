"""The CLI's commands: verify, demo, bench, serve, calibrate."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from .arguments import UsageError, check_head_dim, check_model, require_vllm, resolve_preset
from .environment import environment_report, package_check

ATTENTION_TOLERANCE = 1e-2  # the kernels' bf16 tolerance against the float32 reference (tests/ops)
KEY_ERROR_SLACK = 1.1  # demo: key error at most this times the Lloyd-Max optimum's sqrt(distortion)


def cmd_verify(args: argparse.Namespace) -> int:
    from ..core.presets import DEFAULT_PRESET

    check_head_dim(args.head_dim, [DEFAULT_PRESET])
    from ..core.presets import PRESETS
    from ..core.selftest import distortion_table

    package_ok, package_lines, package = package_check()
    env_lines, env = environment_report()
    table = distortion_table(dim=args.head_dim, num_vectors=args.vectors)
    presets = [
        {"name": p.name, "head_dim": args.head_dim,
         "bytes_per_token_per_head": p.bytes_per_token_per_head(args.head_dim),
         "capacity_vs_bf16": round(p.capacity_vs_bf16(args.head_dim), 4), "summary": p.summary}
        for p in PRESETS.values()
    ]
    math_ok = all(abs(r["mse"] / r["lloyd_max"] - 1) < 0.02 and r["mse"] > r["bound"] for r in table)
    ok = math_ok and package_ok
    if args.json:
        print(json.dumps({"head_dim": args.head_dim, "distortion": table, "presets": presets, "package": package,
                          "environment": env, "math_ok": math_ok, "ok": ok}, indent=1))
        return 0 if ok else 1
    for line in package_lines:
        print(line, file=sys.stdout if line.startswith("package:") else sys.stderr)
    print("\n".join(env_lines))
    print(f"\nTurboQuant-MSE distortion E||x - x_hat||^2 over {args.vectors} random unit vectors, d = {args.head_dim}")
    print(f"{'bits':>4} {'measured':>10} {'optimum':>10} {'ratio':>7} {'gauss lim':>10} {'bound 4^-b':>11}")
    for r in table:
        print(f"{r['bits']:>4} {r['mse']:>10.5f} {r['lloyd_max']:>10.5f} {r['mse'] / r['lloyd_max']:>7.3f} "
              f"{r['gaussian_limit']:>10.5f} {r['bound']:>11.5f}")
    print(f"\npresets at head_dim {args.head_dim} (bf16: {4 * args.head_dim} B per token per KV head)")
    for p in presets:
        print(f"  {p['name']:5s} {p['bytes_per_token_per_head']:4d} B  {p['capacity_vs_bf16']:.2f}x  {p['summary']}")
    if ok:
        print("\nverify: ok (every bit width within 2% of its optimum, above the bound; this project's package)")
    else:
        why = ([] if math_ok else ["distortion off its optimum"])
        why += [] if package_ok else ["not this project's package (see above)"]
        print(f"\nverify: FAILED ({'; '.join(why)})")
    return 0 if ok else 1


def demo_verdict(att_err: float, k_err: float, k_bound: float, k_bits: int) -> tuple[bool, str]:
    att_ok, k_ok = att_err < ATTENTION_TOLERANCE, k_err < k_bound
    return att_ok and k_ok, (f"demo: {'ok' if att_ok and k_ok else 'FAILED'} (attention error "
                             f"{'<' if att_ok else '>='} {ATTENTION_TOLERANCE:.0e}, key error {'<' if k_ok else '>='} "
                             f"{k_bound:.4f} = {KEY_ERROR_SLACK} x the {k_bits}-bit Lloyd-Max optimum)")


def cmd_demo(args: argparse.Namespace) -> int:
    preset_name = resolve_preset(args.preset)
    check_head_dim(args.head_dim, [preset_name])
    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import
    from ..core.codebook import lloyd_max
    from ..core.layout import CacheLayout
    from ..core.presets import get_preset
    from ..ops import paged_attention, store_kv
    from ..ops.attention.naive import paged_attention_reference
    from ..ops.dequant.naive import read_kv_reference

    device = "cuda" if on_gpu else "cpu"
    gen = torch.Generator().manual_seed(0)
    d, kv_heads, q_heads, bs = args.head_dim, 2, 8, 16
    seq_lens = [args.context, args.context // 2 + 1]
    layout = CacheLayout(get_preset(preset_name), d, kv_heads, bs)
    blocks = [math.ceil(n / bs) for n in seq_lens]
    table = torch.arange(sum(blocks), dtype=torch.int32).split(blocks)
    block_table = torch.nn.utils.rnn.pad_sequence(list(table), batch_first=True).to(device)
    cache = torch.zeros(layout.cache_shape(sum(blocks)), dtype=torch.uint8, device=device)
    keys = torch.randn(sum(seq_lens), kv_heads, d, generator=gen).to(torch.bfloat16).to(device)
    values = torch.randn(sum(seq_lens), kv_heads, d, generator=gen).to(torch.bfloat16).to(device)
    slots = torch.cat([table[i].long().repeat_interleave(bs)[:n] * bs + torch.arange(n) % bs
                       for i, n in enumerate(seq_lens)]).to(device)
    store_kv(keys, values, cache, slots, layout)
    k_hat, _ = read_kv_reference(cache, block_table[0], seq_lens[0], layout)
    k_err = ((k_hat - keys[: seq_lens[0]].float()).norm() / keys[: seq_lens[0]].float().norm()).item()
    query = torch.randn(2, q_heads, d, generator=gen).to(torch.bfloat16).to(device)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = torch.empty_like(query)
    paged_attention(query, cache, layout, block_table, qsl, lens, max_query_len=1, scale=d**-0.5, out=out)
    ref = paged_attention_reference(query, cache, layout, block_table, qsl, lens, d**-0.5)
    att_err = ((out.float() - ref).norm() / ref.norm()).item()
    k_bound = KEY_ERROR_SLACK * math.sqrt(lloyd_max(layout.preset.k_bits, d).distortion)
    where = "GPU (native Triton kernels)" if on_gpu else "CPU (Triton interpreter)"
    print(f"turboquant-vllm demo on {where}: preset {layout.preset.name}, head_dim {d}, contexts {seq_lens}")
    print(f"  KV cache: {layout.bytes_per_token_per_head} B per token per KV head vs {4 * d} B bf16 "
          f"-> {layout.preset.capacity_vs_bf16(d):.2f}x compression")
    print(f"  key reconstruction relative error (quantization): {k_err:.4f} (bound {k_bound:.4f})")
    print(f"  decode attention vs float32 reference over the same compressed cache: relative error {att_err:.2e} "
          f"(bound {ATTENTION_TOLERANCE:.0e})")
    ok, verdict = demo_verdict(att_err, k_err, k_bound, layout.preset.k_bits)
    print(verdict)
    return 0 if ok else 1


def cmd_bench(args: argparse.Namespace) -> int:
    presets = args.presets or [resolve_preset(None)]
    check_head_dim(args.head_dim, presets)
    import functools

    import torch

    from ..core.presets import get_preset

    q_heads, kv_heads = args.heads
    if q_heads % kv_heads:
        raise UsageError(f"--heads {q_heads}/{kv_heads}: query heads must be a multiple of KV heads")
    if not torch.cuda.is_available():
        raise UsageError("bench times the kernels natively and needs a CUDA GPU; none is visible here "
                         "(`turboquant-vllm demo` runs them on a CPU, through Triton's interpreter)")
    from ..bench import Batch, Shape, copy_bandwidth, flash, flash_available, measure, ours, table

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
    preset = resolve_preset(args.preset)
    check_model(args.model, need_config=False)
    require_vllm("serve")
    env = dict(os.environ, TURBOQUANT_PRESET=preset)
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model, "--attention-backend", "CUSTOM"]
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd + extra, env)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ..vllm.settings import PRESET_ENV

    preset = resolve_preset(args.preset)
    check_model(args.model, need_config=True)
    for text in args.text:
        if not Path(text).exists():
            raise UsageError(f"--text {text}: no such file or directory")
    out_dir = Path(args.out).expanduser().resolve().parent
    if not out_dir.is_dir():
        raise UsageError(f"--out {args.out}: directory {out_dir} does not exist")
    require_vllm("calibrate")
    os.environ[PRESET_ENV] = preset
    from ..vllm.calibrate import calibrate

    calibrate(args.model, args.text, args.out, max_tokens=args.tokens, window=args.window,
              gpu_memory_utilization=args.gpu_memory_utilization)
    print(f"serve with: TURBOQUANT_KEY_CALIBRATION={args.out} turboquant-vllm serve {args.model} --preset {preset}")
    return 0
