"""Where a decode step's time goes per weight method, in vLLM with CUDA graphs: the step's wall time, its GPU kernel
time split into GEMMs, attention and the rest, and the kernels that take the most.

The rows are those of a weight benchmark (--suite weights: bf16, fp8, quartet2[:path], modelopt_fp4 on the Llama-3-8B
or CloverLM-4B shape; --suite awq: the AWQ methods on the random Llama-3-8B-shaped AWQ checkpoint), each in a child
process built as that benchmark builds it (model, dummy or AWQ weights, quantization, environment), but with the
engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that torch.profiler sees its kernels, graph replays
included. --batch requests of --context random prompt tokens are added and stepped until all of them decode; after
WARM_STEPS more, WALL_STEPS steps are timed (wall, synchronized) and --steps steps profiled: GPU time per kernel
per step. Kernel classes by name: GEMM (Marlin, cuBLAS's nvjet / gemm, CUTLASS GEMMs, TurboMind, Machete, split-K
reductions), attention (FlashAttention, the KV cache write), other (norms, RoPE, activations, sampling, copies).
--cpu records the host too: the ops with the most CPU time of their own per step (where a step's wall time exceeds
its GPU time).

    python -m benchmarks profile_weights [--suite weights|awq] [--model cloverlm-4b|llama3-8b] [--methods ...]
        [--layers N] [--batch 1] [--context 1024] [--steps 32] [--cpu] [--timeout S] [--out PATH]

Writes benchmarks/results/profile_weights/<gpu>-<model>-<layers>l-b<batch>x<context>.{json,md}, the children's logs
in the folder of that name.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

from . import common, engine_rows

NAME = "profile_weights"
TAG = "PROFILE_ROW"
WARM_STEPS, WALL_STEPS, TOP = 16, 64, 12
CLASSES = (("attention", re.compile(r"flash|attn|attention|reshape_and_cache|paged", re.I)),
           ("gemm", re.compile(r"marlin|gemm|nvjet|splitKreduce|turbomind|machete|cutlass", re.I)))


def kernel_class(name: str) -> str:
    """"attention", "gemm" or "other" by the kernel's name (the first class whose pattern it matches); Inductor's
    fused kernels (triton_*) are "other" whatever ops their names list."""
    if name.startswith("triton_"):
        return "other"
    return next((cls for cls, pattern in CLASSES if pattern.search(name)), "other")


def suite(name: str):
    from . import awq, weights

    return {"weights": weights.BENCH, "awq": awq.BENCH}[name]


def suite_arguments(args: argparse.Namespace) -> list[str]:
    """The suite's own command line for the model these rows run: its model, depth and request lengths."""
    out = ["--methods", args.methods, "--input-len", str(args.context), "--output-len", str(generated(args))]
    if args.layers:
        out += ["--layers", str(args.layers)]
    return out + (["--model", args.model] if args.suite == "weights" else [])


def generated(args: argparse.Namespace) -> int:
    """Tokens each request may generate: through the prefill steps, the warm-up, the timed and profiled steps."""
    return WARM_STEPS + WALL_STEPS + args.steps + 64


# ---- the child: one engine, in-process

def profile_engine(llm, vocab: int, batch: int, context: int, max_tokens: int, steps: int, cpu: bool = False) -> dict:
    import random

    import torch
    from vllm import SamplingParams

    engine = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                            detokenize=False)
    for i in range(batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(context)]}, params)
    started: set[str] = set()
    while len(started) < batch:  # the prefill; its first requests decode meanwhile
        started.update(o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids)
    for _ in range(WARM_STEPS):
        engine.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(WALL_STEPS):
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t) / WALL_STEPS * 1e3
    activities = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if cpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    if engine.get_num_unfinished_requests() != batch:
        raise RuntimeError("requests finished inside the profile: raise the tokens they generate")
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name, [0.0, 0.0])
            k[0] += e.time_range.elapsed_us() / steps
            k[1] += 1 / steps
    out = dict(step_wall_ms=wall_ms, kernels={name: dict(us=us, launches=n) for name, (us, n) in kernels.items()})
    if cpu:  # the host's side: each op's own time (its children's left out) and calls, per step
        out["host_ops"] = {e.key: dict(us=e.self_cpu_time_total / steps, calls=e.count / steps)
                           for e in prof.key_averages() if e.self_cpu_time_total > 0}
    return out


def child(args: argparse.Namespace) -> None:
    bench = suite(args.suite)
    method, variant = bench.parse_method(args.child)
    config = json.loads((Path(args.model_dir) / "config.json").read_text())
    bench.prepare_child(method, variant, config)
    from vllm import LLM

    llm = LLM(**bench.llm_kwargs(method, variant, str(args.model_dir), args.context, generated(args),
                                 args.gpu_memory_utilization))
    row = dict(bench.identity(args.child), **engine_rows.engine_facts(llm), **bench.child_facts(method))
    row.update(profile_engine(llm, config["vocab_size"], args.batch, args.context, generated(args), args.steps,
                              args.cpu))
    engine_rows.emit_row(TAG, row)


# ---- the parent

def child_arguments(args: argparse.Namespace) -> list[str]:
    """The options a row's child is started with (all but the parent's own: --timeout, --out)."""
    return ["--suite", args.suite, "--model", args.model, "--methods", args.methods, "--batch", str(args.batch),
            "--context", str(args.context), "--steps", str(args.steps), "--gpu-memory-utilization",
            str(args.gpu_memory_utilization), *(["--layers", str(args.layers)] if args.layers else []),
            *(["--cpu"] if args.cpu else [])]


def summarize(row: dict) -> dict:
    """The row's kernel time per class and in all (ms per step), launches per step, and its top kernels."""
    kernels = row.get("kernels") or {}
    by_class = {cls: 0.0 for cls, _ in CLASSES} | {"other": 0.0}
    for name, k in kernels.items():
        by_class[kernel_class(name)] += k["us"] / 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[:TOP]
    out = dict(kernel_ms=sum(by_class.values()), **{f"{cls}_ms": ms for cls, ms in by_class.items()},
               launches=sum(k["launches"] for k in kernels.values()),
               top=[dict(name=name, us=k["us"], launches=k["launches"], cls=kernel_class(name)) for name, k in top])
    if row.get("host_ops"):
        host = sorted(row["host_ops"].items(), key=lambda kv: -kv[1]["us"])[:TOP]
        out["top_host"] = [dict(name=name, us=o["us"], calls=o["calls"]) for name, o in host]
    return out


def markdown(rows: list[dict], model: dict, args: argparse.Namespace) -> str:
    out = [f"One decode step of {args.batch} request(s) at {args.context} prompt tokens, "
           f"{engine_rows.shape_text(model)}, vLLM with CUDA graphs, engine in-process. Wall: ms per step over "
           f"{WALL_STEPS} steps; GPU: kernel time per step over {args.steps} profiled steps (torch.profiler), by "
           "class.", "",
           "| method | kernel | step wall ms | GPU kernels ms | GEMM ms | attention ms | other ms | launches / step |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "kernel_ms" not in r:
            out.append(f"| {r['label']} | **failed**: {r.get('error')} | | | | | | |")
            continue
        out.append(f"| {r['label']} | {r.get('kernel') or ''} | {r['step_wall_ms']:.3f} | {r['kernel_ms']:.3f} | "
                   f"{r['gemm_ms']:.3f} | {r['attention_ms']:.3f} | {r['other_ms']:.3f} | {r['launches']:.0f} |")
    for r in rows:
        if "top" in r:
            out += ["", f"{r['label']}: the {TOP} kernels taking the most GPU time per step", "",
                    "| µs / step | launches / step | class | kernel |", "| --- | --- | --- | --- |"]
            out += [f"| {k['us']:.1f} | {k['launches']:.1f} | {k['cls']} | `{k['name'][:110]}` |" for k in r["top"]]
        if "top_host" in r:
            out += ["", f"{r['label']}: the {TOP} host ops taking the most CPU time per step (self time)", "",
                    "| µs / step | calls / step | op |", "| --- | --- | --- |"]
            out += [f"| {o['us']:.1f} | {o['calls']:.1f} | `{o['name'][:110]}` |" for o in r["top_host"]]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--suite", choices=["weights", "awq"], default="weights")
    ap.add_argument("--model", default="cloverlm-4b", help="--suite weights' model (default: %(default)s)")
    ap.add_argument("--methods", help="the suite's rows (default: weights bf16,quartet2:marlin,modelopt_fp4; "
                    "awq awq_marlin:marlin,awq_marlin:machete,awq_turbomind)")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the suite's)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--cpu", action="store_true", help="profile the host too: the ops taking the most CPU time")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--timeout", type=float, default=0, help="seconds a row may take (0: no limit)")
    common.add_out_argument(ap, f"benchmarks/results/{NAME}/<gpu>-<model>-<layers>l-b<batch>x<context>")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.methods = args.methods or ("bf16,quartet2:marlin,modelopt_fp4" if args.suite == "weights"
                                    else "awq_marlin:marlin,awq_marlin:machete,awq_turbomind")
    if args.child:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        child(args)
        return
    bench = suite(args.suite)
    sargs = bench.arguments(suite_arguments(args))
    model = bench.model(sargs)
    model_name = bench.model_name(sargs)
    stem = (common.stem_of(args.out) if args.out else
            common.result_stem(NAME, f"{model_name}-{sargs.layers}l-b{args.batch}x{args.context}"))
    logs = stem.parent / stem.name
    command = common.command_line(NAME, argv)
    meta = common.provenance(command)
    rows = []
    with bench.model_dirs(sargs, model) as model_dir:
        for spec in sargs.method_list:
            cmd = common.module_command(NAME, *child_arguments(args), "--child", spec, "--model-dir",
                                        str(model_dir(spec)))
            method, variant = bench.parse_method(spec)
            with bench.environment(method, variant) as env:
                row = engine_rows.measure_row(cmd, logs / engine_rows.row_log_name(spec), args.timeout, command,
                                              bench.identity(spec), TAG, bench.kernel_patterns, env)
            row.update(summarize(row) if row.get("kernels") else {})
            row.pop("kernels", None)
            row.pop("host_ops", None)
            rows.append(row)
            print({k: v for k, v in row.items() if k not in ("top", "top_host")}, flush=True)
            settings = dict(suite=args.suite, batch=args.batch, context=args.context, steps=args.steps,
                            wall_steps=WALL_STEPS, warm_steps=WARM_STEPS)
            common.write_json(common.with_ext(stem, ".json"), dict(rows=rows, meta=dict(model=model, **settings)),
                              meta)
            common.write_markdown(common.with_ext(stem, ".md"), markdown(rows, model, args), meta)
    print(f"wrote {stem}.json / .md", flush=True)


if __name__ == "__main__":
    main()
