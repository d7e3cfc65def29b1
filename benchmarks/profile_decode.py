"""Where a decode step's GPU time goes: CUDA time per kernel per decode step, for each KV cache.

The e2e model shape (benchmarks.e2e, random weights) runs in vLLM in-process and eager, so every
kernel shows up under torch.profiler by name. The engine is stepped by hand: once every request
has finished its prefill, STEPS steps in which all of them decode are profiled. GPU time per
kernel per step, and launches per step and layer: under CUDA graphs each launch still costs its
own GPU time and a gap. (The wall time of such steps as served, graphs and host work included, is
e2e.py's decode_only_tok_s.)

    python -m benchmarks profile_decode [--kv bf16,tq4] [--batch 64 --context 8192] [--heads 16/4] [--out PATH]
Writes benchmarks/results/profile_decode/<gpu>-[<Q>q<KV>kv-]<batch>x<context>.{json,md} (e.g. h200-64x8k; the heads
only where they are not the e2e model's 16 / 4), the children's logs in the folder of that name.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from . import common
from .e2e import HEADS, KV, child_row, fit_positions, model_config

NAME = "profile_decode"
STEPS = 16
MAX_GENERATED = 512


def decode_kernel_times(llm, prompts: list, steps: int) -> dict[str, tuple[float, int]]:
    """CUDA kernel name -> (total µs, launches) over `steps` engine steps in which every request decodes."""
    import torch
    from vllm import SamplingParams

    engine = llm.llm_engine
    # Long enough that the first requests, decoding since early in the others' chunked prefill, still run.
    params = SamplingParams(max_tokens=MAX_GENERATED, ignore_eos=True, temperature=0.0)
    ids = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    started: set[str] = set()
    while len(started) < len(prompts):  # the prefill, in chunks; its first requests already decode meanwhile
        started.update(o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids)
    for _ in range(2):  # every request decodes from here on; the first steps compile what is left
        engine.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    running = engine.get_num_unfinished_requests()
    engine.abort_request(ids)
    if running != len(prompts):
        raise RuntimeError(f"{running} of {len(prompts)} requests ran through the profile: raise MAX_GENERATED")
    out: dict[str, tuple[float, int]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t, n = out.get(e.name, (0.0, 0))
            out[e.name] = (t + e.time_range.elapsed_us(), n + 1)
    return out


def profile(kv: str, model_dir: str, batch: int, context: int, layers: int) -> dict:
    """Runs inside a fresh process: one engine, one KV cache."""
    import random

    from vllm import LLM

    backend, dtype, _ = KV[kv]
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, max_model_len=context + MAX_GENERATED,
              gpu_memory_utilization=0.85, enable_prefix_caching=False, seed=0, kv_cache_dtype=dtype,
              max_num_seqs=batch, enforce_eager=True,
              **({"attention_config": {"backend": backend}} if backend else {}))
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 32000) for _ in range(context)]} for _ in range(batch)]
    times = decode_kernel_times(llm, prompts, STEPS)
    kernels = [dict(name=name, us_per_step=t / STEPS, launches_per_step=n / STEPS) for name, (t, n) in times.items()]
    kernels.sort(key=lambda k: -k["us_per_step"])
    total = sum(k["us_per_step"] for k in kernels)
    launches = sum(k["launches_per_step"] for k in kernels)
    return dict(kv=kv, batch=batch, context=context, us_per_step=total, launches_per_step=launches,
                launches_per_layer=launches / layers, kernels=kernels)


def default_stem(heads: str, batch: int, context: int, gpu: str | None = None) -> Path:
    """benchmarks/results/profile_decode/<gpu>-[<Q>q<KV>kv-]<batch>x<context>."""
    q, kv = heads.split("/")
    return common.result_stem(NAME, ("" if heads == HEADS else f"{q}q{kv}kv-") + common.shape_tag(batch, context), gpu)


def markdown(rows: list[dict], command: str) -> str:
    lines = [f"Command: `{command}`", ""]
    for r in rows:
        lines += [f"## {r['kv']}: {r['batch']} x {r['context']}, GPU time {r['us_per_step']:,.0f} µs per decode step, "
                  f"{r['launches_per_step']:.0f} launches ({r['launches_per_layer']:.1f} per layer)", "",
                  "| kernel | µs per step | launches per step |", "| --- | ---: | ---: |"]
        for k in r["kernels"][:20]:
            lines.append(f"| `{k['name'][:90]}` | {k['us_per_step']:,.1f} | {k['launches_per_step']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--kv", default="bf16,tq4")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--heads", default=HEADS)
    common.add_out_argument(ap, "benchmarks/results/profile_decode/<gpu>-<batch>x<context>")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    model = fit_positions(model_config(args.heads), args.context + MAX_GENERATED)
    if args.child:
        kv, model_dir = args.child.split(":", 1)
        row = profile(kv, model_dir, args.batch, args.context, model["num_hidden_layers"])
        print("PROFILE_ROW " + json.dumps(row), flush=True)
        return
    stem = common.stem_of(args.out) if args.out else default_stem(args.heads, args.batch, args.context)
    stem.mkdir(parents=True, exist_ok=True)  # the children's logs
    rows = []
    command = common.command_line(NAME, argv)
    provenance = common.provenance(command)
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(model))
        for kv in args.kv.split(","):
            env = common.child_env(dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **KV[kv][2]))
            cmd = common.module_command(NAME, "--batch", str(args.batch), "--context", str(args.context),
                                        "--heads", args.heads, "--child", f"{kv}:{model_dir}")
            row = child_row(cmd, env, stem / f"{kv}.log", "PROFILE_ROW")
            if row is None:
                continue
            rows.append(row)
            write(rows, stem, command, model, provenance)  # after every row: a cut-off run keeps what it measured
    print(markdown(rows, command))


def write(rows: list[dict], stem: Path, command: str, model: dict, provenance: dict) -> None:
    common.write_json(common.with_ext(stem, ".json"), dict(command=command, model=model, rows=rows), provenance)
    common.write_markdown(common.with_ext(stem, ".md"), markdown(rows, command), provenance)


if __name__ == "__main__":
    main()
