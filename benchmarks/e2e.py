"""vLLM end to end: KV tokens that fit, decode and prefill throughput, for each KV cache, side by side.

A Llama-shaped model with random weights (16 layers, hidden 2048, 16 query / 4 KV heads,
head_dim 128), gpu_memory_utilization 0.85, full CUDA graphs for decode, no prefix caching.
Decode tok/s = requests x (generated - 1) / (time of the full run - time of a prefill-only run),
the median over --repeats pairs (the kit's definition, ../shared/gpu/README.md). The engine is stepped
as LLM.generate steps it, each step timed, so the same runs also split the full run's time: the
steps while some request still prefills (their excess over the prefill-only run is what the
decodes riding along cost) and the steps after, where every token is a decode
(decode_only_tok_s_*: those steps' tokens / their time). --at-limit CONTEXT adds requests/s with as many CONTEXT-token
requests as the KV cache holds, each generating --at-limit-generate tokens (128: a prefill-bound load; ~1024 and up:
a decode-bound one, where the tokens a cache holds count).
Each KV cache runs in its own process (vLLM engines do not tear down cleanly in one).

    python -m benchmarks e2e [--kv bf16,fp8,tq4,tq3] [--runs 64x8192,32x32768] [--at-limit 8192
                             [--at-limit-generate N]] [--capture-max N] [--heads 32/8 | --shape NAME] [--tp 2]
                             [--out PATH]
--shape takes a real model's shape instead of the Llama one (SHAPES: qwen2.5-7b, smollm2-135m, phi3-mini, gemma2-9b;
random weights, its layers cut to 8 where it has more, positions extended so the runs fit); the results go to
benchmarks/results/e2e/<gpu>-<shape>[-...].
The default configuration (16 q / 4 KV heads, tensor parallel 1, the default --runs, no --at-limit) writes the
headline benchmarks/results/e2e.{json,md,png}; any other writes benchmarks/results/e2e/<gpu>-<what>.{json,md,png},
<what> = llama<layers>l-<Q>q<KV>kv[-tp<N>][-<runs>][-at-limit-<context>-gen<N>], e.g. h200-llama16l-32q8kv for
--heads 32/8. The children's logs go to the folder of that name (benchmarks/results/e2e/<gpu>-llama16l-16q4kv/ for
the headline), one <kv>.log each.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from . import common

NAME = "e2e"
RUNS = "64x8192,32x32768"
HEADS = "16/4"
MODEL = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=5632,
    num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=32000,
    max_position_embeddings=40960, rms_norm_eps=1e-5, rope_theta=10000.0, torch_dtype="bfloat16",
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)


# Real models' shapes for --shape: (config.json, extra engine arguments). The attention and weight shapes per layer are
# the real ones; deep models keep 8 layers (the ratio of KV to weight bytes per layer is what decode speed meets).
_COMMON = dict(torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, max_position_embeddings=40960)
SHAPES = {
    # a query-head group of 7, qkv bias
    "qwen2.5-7b": (dict(_COMMON, architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584,
                        intermediate_size=18944, num_hidden_layers=8, num_attention_heads=28, num_key_value_heads=4,
                        head_dim=128, vocab_size=152064, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
                        use_sliding_window=False), {}),
    # head_dim 64, a group of 3: the real model of the quality table, all 30 layers
    "smollm2-135m": (dict(_COMMON, architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576,
                          intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                          head_dim=64, vocab_size=49152, rms_norm_eps=1e-5, rope_theta=1e5, tie_word_embeddings=True),
                     {}),
    # head_dim 96, no GQA (the real model's 2047-token window left out)
    "phi3-mini": (dict(_COMMON, architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=3072,
                       intermediate_size=8192, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=32,
                       vocab_size=32064, rms_norm_eps=1e-5, rope_theta=1e4, tie_word_embeddings=False,
                       sliding_window=None), {}),
    # head_dim 256, soft-capped scores, sliding window on alternate layers (one KV-cache group: our page sizes)
    "gemma2-9b": (dict(_COMMON, architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=3584,
                       intermediate_size=14336, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=256, vocab_size=256000, rms_norm_eps=1e-6, rope_theta=1e4, tie_word_embeddings=True,
                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096,
                       query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh"),
                  {"disable_hybrid_kv_cache_manager": True}),
}


def model_config(heads: str) -> dict:
    """The model for "Q/KV" query / KV heads (hidden = Q x 128)."""
    q, kv = (int(x) for x in heads.split("/"))
    if (q, kv) == (16, 4):
        return MODEL
    return dict(MODEL, hidden_size=q * 128, intermediate_size=int(q * 128 * 2.6875), num_attention_heads=q,
                num_key_value_heads=kv)


def fit_positions(model: dict, tokens: int) -> dict:
    """The model's config with positions for sequences of `tokens` (1 x 100k on the Llama shape), its own where they
    suffice."""
    return model if tokens <= model["max_position_embeddings"] else dict(model, max_position_embeddings=tokens)


def config_name(model: dict, tp: int = 1, runs: str = RUNS, at_limit: int = 0, at_limit_generate: int = 0,
                shape: str | None = None) -> str:
    """<what> of the result path: <shape> or llama<layers>l-<Q>q<KV>kv, then
    [-tp<N>][-<runs>][-at-limit-<context>-gen<N>]."""
    heads = f"{model['num_attention_heads']}q{model['num_key_value_heads']}kv"
    name = shape or f"llama{model['num_hidden_layers']}l-{heads}"
    name += f"-tp{tp}" if tp > 1 else ""
    if runs != RUNS:
        name += "-" + "-".join(common.shape_tag(*(int(x) for x in r.split("x"))) for r in runs.split(","))
    if at_limit:
        context = f"{at_limit // 1024}k" if at_limit % 1024 == 0 else str(at_limit)
        name += f"-at-limit-{context}-gen{at_limit_generate}"
    return name


def result_paths(model: dict, tp: int = 1, runs: str = RUNS, at_limit: int = 0, at_limit_generate: int = 0,
                 gpu: str | None = None, shape: str | None = None) -> tuple[Path, Path]:
    """(the results' path without extension, the children's log folder) of a configuration: the headline
    benchmarks/results/e2e for the default one, benchmarks/results/e2e/<gpu>-<what> otherwise."""
    what = common.result_stem(NAME, config_name(model, tp, runs, at_limit, at_limit_generate, shape), gpu)
    if model == MODEL and tp == 1 and runs == RUNS and not at_limit:
        return common.RESULTS / NAME, what
    return what, what


# kv name -> (attention backend, None: vLLM's pick; kv_cache_dtype; extra environment). vLLM's compressed caches
# that run on Hopper are named by their kv_cache_dtype (common.VLLM_KV); the others are a line of the report.
KV = {
    "bf16": ("FLASH_ATTN", "auto", {}),
    "fp8": ("FLASH_ATTN", "fp8", {}),
    **{dtype: (backend, dtype, {}) for dtype, backend in common.VLLM_KV.items()},
    "tq4": ("CUSTOM", "auto", {"TURBOQUANT_PRESET": "tq4"}),
    "tq3": ("CUSTOM", "auto", {"TURBOQUANT_PRESET": "tq3"}),
    "k4v3": ("CUSTOM", "auto", {"TURBOQUANT_PRESET": "k4v3"}),
}
GENERATED = 128
MAX_SEQS_AT_LIMIT = 2048


class Steps:
    """One run's engine steps: wall seconds and tokens produced, apart for the steps taken while some
    request was still prefilling (decodes of the others ride along) and the decode-only steps after."""

    def __init__(self) -> None:
        self.seconds = 0.0  # the whole run, adding the requests included
        self.time = {True: 0.0, False: 0.0}  # keyed by "some request was prefilling"
        self.count = {True: 0, False: 0}
        self.tokens = {True: 0, False: 0}
        self.slowest = (0.0, -1)  # (seconds, index) of the longest step: where a one-time stall shows

    def add(self, prefilling: bool, seconds: float, tokens: int) -> None:
        self.slowest = max(self.slowest, (seconds, sum(self.count.values())))
        self.time[prefilling] += seconds
        self.count[prefilling] += 1
        self.tokens[prefilling] += tokens

    @property
    def decode_only_tok_s(self) -> float | None:
        return self.tokens[False] / self.time[False] if self.count[False] else None

    def summary(self) -> dict:
        return dict(seconds=self.seconds, prefill_phase_s=self.time[True], prefill_phase_steps=self.count[True],
                    prefill_phase_tokens=self.tokens[True], decode_only_s=self.time[False],
                    decode_only_steps=self.count[False], decode_only_tokens=self.tokens[False],
                    slowest_step_s=self.slowest[0], slowest_step=self.slowest[1])


def engine(kv: str, model_dir: str, runs: list[tuple[int, int]], repeats: int, at_limit: int,
           at_limit_generate: int = GENERATED, capture_max: int = 0, tp: int = 1,
           engine_args: dict | None = None) -> dict:
    """Runs inside a fresh process: one engine, every measurement for this KV cache."""
    import random
    import statistics

    from vllm import LLM, SamplingParams

    backend, dtype, _ = KV[kv]
    longest = max([c for _, c in runs] + [at_limit])
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True,
              max_model_len=longest + max(GENERATED, at_limit_generate) + 8,
              gpu_memory_utilization=0.85, enable_prefix_caching=False, seed=0, kv_cache_dtype=dtype,
              max_num_seqs=MAX_SEQS_AT_LIMIT if at_limit else max(b for b, _ in runs), tensor_parallel_size=tp,
              compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                  **({"max_cudagraph_capture_size": capture_max} if capture_max else {})},
              **({"attention_config": {"backend": backend}} if backend else {}), **(engine_args or {}))
    cache = llm.llm_engine.vllm_config.cache_config
    sched = llm.llm_engine.vllm_config.scheduler_config
    # What shapes the steps (and so the decode figure, see NOTES.md): kept with the row.
    # kv_tokens: vLLM's group-aware capacity (config/cache.py: num_gpu_blocks x block_size can be wrong where a
    # request spans several KV-cache groups, as the in-tree turboquant's bf16 boundary layers may make)
    row = {"kv": kv, "kv_tokens": cache.kv_cache_size_tokens, "tensor_parallel_size": tp,
           "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
           "max_cudagraph_capture_size": llm.llm_engine.vllm_config.compilation_config.max_cudagraph_capture_size}
    rng = random.Random(0)

    request_ids = itertools.count()  # unique across the runs of one engine

    def timed(prompts: list, max_tokens: int) -> Steps:
        """LLM.generate's loop (add every request, step until none is left), each step timed."""
        engine = llm.llm_engine
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        steps = Steps()
        t0 = time.perf_counter()
        for p in prompts:
            engine.add_request(str(next(request_ids)), p, params)
        generated: dict[str, int] = {}
        while engine.has_unfinished_requests():
            prefilling = len(generated) < len(prompts)  # some request has not produced its first token yet
            t = time.perf_counter()
            outs = engine.step()
            new = 0
            for o in outs:
                n = len(o.outputs[0].token_ids)
                new += n - generated.get(o.request_id, 0)
                generated[o.request_id] = n
                assert not o.finished or n == max_tokens
            steps.add(prefilling, time.perf_counter() - t, new)
        steps.seconds = time.perf_counter() - t0
        assert len(generated) == len(prompts)
        return steps

    def random_prompts(n: int, length: int) -> list:
        return [{"prompt_token_ids": [rng.randrange(3, 32000) for _ in range(length)]} for _ in range(n)]

    for batch, context in runs:
        prompts = random_prompts(batch, context)
        # Warm-up: a full run, so the measured pairs meet no first-time code path (decodes riding along shift the
        # prefill chunks; a prefill-only warm-up left tq4's first full run 1.4 s slower on the H200).
        warm_up = timed(prompts, GENERATED)
        # Decode time = full run - prefill-only run; each is noisy, so take the median of pairs.
        pairs = [(timed(prompts, 1), timed(prompts, GENERATED)) for _ in range(repeats)]
        shape = f"{batch}x{context // 1024}k"
        prefill = statistics.median(p.seconds for p, _ in pairs)
        decode = statistics.median(f.seconds - p.seconds for p, f in pairs)
        row[f"decode_tok_s_{shape}"] = batch * (GENERATED - 1) / decode
        row[f"prefill_tok_s_{shape}"] = batch * context / prefill
        row[f"decode_only_tok_s_{shape}"] = statistics.median(f.decode_only_tok_s for _, f in pairs)
        row[f"steps_{shape}"] = [dict(f.summary(), prefill_only_s=p.seconds) for p, f in pairs]  # each pair
        row[f"warm_up_steps_{shape}"] = warm_up.summary()  # a first-time stall shows here as its slowest step
    if at_limit:  # as many requests as the cache holds, all at once
        n = min(row["kv_tokens"] // (at_limit + at_limit_generate), MAX_SEQS_AT_LIMIT)
        steps = timed(random_prompts(n, at_limit), at_limit_generate)
        row.update(at_limit_requests=n, at_limit_req_s=n / steps.seconds, at_limit_generated=at_limit_generate,
                   at_limit_output_tok_s=n * at_limit_generate / steps.seconds, at_limit_steps=steps.summary())
    return row


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--kv", default=",".join(KV))
    ap.add_argument("--runs", default=RUNS, help="BATCHxCONTEXT,...")
    common.add_out_argument(ap, "benchmarks/results/e2e (default configuration), benchmarks/results/e2e/<gpu>-<what>")
    ap.add_argument("--repeats", type=int, default=3, help="prefill-only / full run pairs per shape (median)")
    ap.add_argument("--at-limit", type=int, default=0, metavar="CONTEXT",
                    help="also serve as many CONTEXT-token requests as the cache holds, at once (e.g. 8192)")
    ap.add_argument("--at-limit-generate", type=int, default=GENERATED, metavar="N",
                    help="tokens each memory-limit request generates")
    ap.add_argument("--capture-max", type=int, default=0, metavar="N",
                    help="capture decode CUDA graphs up to N requests (vLLM's default: min(2 x max_num_seqs, 512)); "
                    "a memory-limit load runs more requests at once than that")
    ap.add_argument("--heads", default=HEADS, help="query / KV heads of the model (16/4: the kit's reference shape)")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a real model's shape instead of the Llama one")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (each GPU holds its share of the KV "
                    "heads, so KV tokens are what the group holds)")
    ap.add_argument("--merge", action="store_true", help="keep rows of other KV caches already in the results")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    runs = [tuple(int(x) for x in r.split("x")) for r in args.runs.split(",")]
    if args.child:
        kv, model_dir = args.child.split(":", 1)
        row = engine(kv, model_dir, runs, args.repeats, args.at_limit, args.at_limit_generate, args.capture_max,
                     args.tp, SHAPES[args.shape][1] if args.shape else None)
        print("E2E_ROW " + json.dumps(row), flush=True)
        return
    model = SHAPES[args.shape][0] if args.shape else model_config(args.heads)
    model = fit_positions(model, max([c for _, c in runs] + [args.at_limit]) + max(GENERATED, args.at_limit_generate)
                          + 8)
    stem, logs = result_paths(model, args.tp, args.runs, args.at_limit, args.at_limit_generate, shape=args.shape)
    if args.out:
        stem = logs = common.stem_of(args.out)
    logs.mkdir(parents=True, exist_ok=True)
    command = common.command_line(NAME, argv)
    provenance = common.provenance(command)
    rows = []
    found = common.with_ext(stem, ".json")
    if args.merge and found.exists():  # keep the other KV caches' rows of an earlier call
        rows = [r for r in json.loads(found.read_text())["rows"] if r["kv"] not in args.kv.split(",")]
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(model))
        for kv in args.kv.split(","):
            cmd = common.module_command(
                NAME, "--runs", args.runs, "--repeats", str(args.repeats), "--at-limit", str(args.at_limit),
                "--at-limit-generate", str(args.at_limit_generate), "--capture-max", str(args.capture_max),
                "--tp", str(args.tp), "--heads", args.heads, *(["--shape", args.shape] if args.shape else []),
                "--child", f"{kv}:{model_dir}")
            row = child_row(cmd, common.child_env(dict(os.environ, **KV[kv][2])), logs / f"{kv}.log", "E2E_ROW")
            if row is None:
                continue
            rows.append(dict(row, command=command))
            print(rows[-1], flush=True)
            write(rows, stem, args.runs, model, provenance, args.shape)  # after every row: a cut-off run keeps
            # what it measured


def child_row(cmd: list[str], env: dict, log: Path, tag: str) -> dict | None:
    """One KV cache's measurement in a fresh process (vLLM engines do not tear down cleanly in one):
    its output goes to `log`, its result is the JSON after `tag` on its last such stdout line."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    log.write_text(proc.stdout[-20000:] + proc.stderr[-20000:])
    found = [line for line in proc.stdout.splitlines() if line.startswith(tag + " ")]
    if not found:
        print(f"{cmd[-1]}: failed (rc {proc.returncode}); see {log}")
        return None
    return json.loads(found[-1][len(tag) + 1:])


def write(rows: list[dict], stem: Path, runs: str, model: dict = MODEL, provenance: dict | None = None,
          shape_name: str | None = None) -> None:
    """stem.json ({"meta", "rows"}: the headline schema), stem.md (the table), stem.png (three panels)."""
    provenance = provenance or common.provenance(common.command_line(NAME, []))
    base = next((r for r in rows if r["kv"] == "bf16"), None)
    for r in rows:  # the schema: prefill_tok_s is the 64 x 8k prefill figure
        r.setdefault("decode_tok_s_64x8k", None)
        r.setdefault("decode_tok_s_32x32k", None)
        r["prefill_tok_s"] = r.get("prefill_tok_s_64x8k")
        if base:
            r["kv_tokens_vs_bf16"] = r["kv_tokens"] / base["kv_tokens"]
    meta = dict(model=model, runs=runs, generated=GENERATED, shape=shape_name,
                tensor_parallel_size=rows[0].get("tensor_parallel_size", 1))
    common.write_json(common.with_ext(stem, ".json"), dict(meta=meta, rows=rows), provenance)
    fmt = lambda x, f: "" if x is None else format(x, f)  # noqa: E731
    tags = [common.shape_tag(*(int(x) for x in r.split("x"))) for r in runs.split(",")]  # the runs measured
    prefill_tag = "64x8k" if "64x8k" in tags else tags[-1]
    lines = ["| kv | KV tokens | vs bf16 | " + " | ".join(f"decode tok/s {t}" for t in tags) + " | "
             + " | ".join(f"decode-only steps {t}" for t in tags)
             + f" | prefill tok/s {prefill_tag} | requests/s at the memory limit |",
             "| --- " * (5 + 2 * len(tags)) + "|"]
    for r in rows:
        lines.append(f"| {r['kv']} | {r['kv_tokens']:,} | {fmt(r.get('kv_tokens_vs_bf16'), '.2f')}x | "
                     + "".join(f"{fmt(r.get(f'decode_tok_s_{t}'), ',.0f')} | " for t in tags)
                     + "".join(f"{fmt(r.get(f'decode_only_tok_s_{t}'), ',.0f')} | " for t in tags)
                     + f"{fmt(r.get(f'prefill_tok_s_{prefill_tag}'), ',.0f')} | "
                     f"{fmt(r.get('at_limit_req_s'), '.2f')} |")
    head_dim = model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
    shape = (f"{model['num_hidden_layers']} layers, hidden {model['hidden_size']}, {model['num_attention_heads']} q / "
             f"{model['num_key_value_heads']} KV heads, head_dim {head_dim}"
             + (f", tensor parallel {meta['tensor_parallel_size']}" if meta["tensor_parallel_size"] > 1 else ""))
    runs_by = {}  # rows merged from earlier calls (--merge) name the command that measured them
    for r in rows:
        runs_by.setdefault(r.get("command", "unrecorded"), []).append(r["kv"])
    measured = "\n".join(f"- {', '.join(kvs)}: `{cmd}`" for cmd, kvs in runs_by.items())
    loads = sorted({r["at_limit_generated"] for r in rows if r.get("at_limit_generated")})
    load = f"\n\nMemory-limit load: {' / '.join(map(str, loads))} tokens generated per request." if loads else ""
    steps = ("\n\nDecode tok/s: requests x (generated - 1) / (full run - prefill-only run), as in the kit's README; "
             "decode-only steps: tokens / time of the full run's steps after every request has finished its prefill "
             "(its earlier tokens come from decodes riding along in prefill steps; per-pair figures in the JSON).")
    title = f"{shape_name} shape ({model['architectures'][0]})" if shape_name else "Llama shape"
    common.write_markdown(common.with_ext(stem, ".md"), f"{title} with random weights: {shape}.\n\n"
                          + "\n".join(lines) + steps + load + f"\n\nMeasured by:\n{measured}\n\n"
                          + common.not_on_hopper_markdown(), provenance)
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 1 + len(tags), figsize=(4.3 * (1 + len(tags)), 4))
    names = [r["kv"] for r in rows]
    for ax, key, title in zip(axes, ["kv_tokens", *(f"decode_tok_s_{t}" for t in tags)],
                              ["KV tokens that fit", *(f"decode tok/s, {t.replace('x', ' x ')}" for t in tags)]):
        ax.bar(names, [r.get(key) or 0 for r in rows])
        ax.set_title(title)
        plt.setp(ax.get_xticklabels(), rotation=40, ha="right")
    fig.suptitle(shape)
    fig.tight_layout()
    fig.savefig(common.with_ext(stem, ".png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
