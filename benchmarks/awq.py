"""AWQ int4 serving end to end in vLLM, side by side: output tok/s and batch-1 decode latency per AWQ kernel.

A Llama-3-8B-shaped AWQ checkpoint with random codes (group 128, fp16; quant.awq_turbomind.checkpoint.random_checkpoint:
hidden 4096, intermediate 14336, 32 q / 8 KV heads, head_dim 128, vocab 128256, --layers of them), no tokenizer,
random prompt token ids (fixed seed), ignore_eos, greedy, no prefix caching, vLLM's default compilation and CUDA
graphs (awq_turbomind: compiled without graphs, see quant.awq_turbomind.method.check_no_cuda_graphs),
gpu_memory_utilization 0.85. Rows (--methods, each <quantization>[:<linear backend>],
the backend passed as LLM(linear_backend=...), i.e. --linear-backend):

- awq_marlin: vLLM's AWQ method, the kernel vLLM picks here (on Hopper: MacheteLinearKernel);
- awq_marlin:marlin, awq_marlin:machete: the same method with --linear-backend marlin / machete;
- awq:triton: vLLM's Triton kernel (TritonW4A16LinearKernel). In vLLM 0.25 `-q awq` and `-q awq_marlin` are one method
  (auto_awq) choosing among the same kernels, so plain `awq` is the default row again; its old Triton AWQ GEMM
  (AutoAWQLinearMethod) is reached only for layers Marlin cannot take or under VLLM_BATCH_INVARIANT;
- awq_turbomind: ours, TurboMind's int4 GEMM (`-q awq_turbomind`).

The kernel of each row is the one the engine's log names ("Using MacheteLinearKernel for AutoAWQMarlinLinearMethod",
"... on the GEMM kernels of turbomind 0.0.2"). Output tok/s = output tokens / wall time of one llm.generate over
--prompts requests of --input-len tokens generating --output-len each (after a warm-up generate). Batch-1 decode
latency = (time of one request generating --output-len tokens - time of the same request generating 1) /
(--output-len - 1), the median of 3 pairs. Each row runs in its own process (vLLM engines do not tear down cleanly in
one); a row that fails (or runs past --timeout) is written with its error, and the results are written after every row,
so a cut-off run keeps what it measured.

    python -m benchmarks awq [--methods awq_marlin,awq_marlin:marlin,awq_marlin:machete,awq:triton,awq_turbomind]
        [--prompts 1000] [--input-len 1024] [--output-len 128] [--layers 32] [--gpu-memory-utilization 0.85]
        [--checkpoint DIR] [--timeout S] [--out PATH] [--merge]

The default configuration (32 layers, 1000 x 1024 in / 128 out) writes the headline
benchmarks/results/awq.{json,md,png}; any other writes
benchmarks/results/awq/<gpu>-llama3-8b-<layers>l-<prompts>x<in>-<out>.{json,md,png}. The children's logs go to
benchmarks/results/awq/<gpu>-<that name>/ (the --out path's folder of its name with --out), <row>.log each.
The checkpoint is written once into --checkpoint (default: <tmp>/turboquant-awq-bench/llama3-8b-<layers>l-g128) and
reused by later calls while its config.json is the same.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from . import common

NAME = "awq"
METHODS = "awq_marlin,awq_marlin:marlin,awq_marlin:machete,awq:triton,awq_turbomind"
OURS = "awq_turbomind"
GROUP = 128
PROMPTS, INPUT_LEN, OUTPUT_LEN, LAYERS = 1000, 1024, 128, 32
LATENCY_REPEATS = 3
WARMUP_PROMPTS = 16
TAG = "AWQ_ROW"
# Llama-3-8B's shape (config.json of meta-llama/Meta-Llama-3-8B, fp16: AWQ's kernels and TurboMind's are fp16)
MODEL = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=LAYERS, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, torch_dtype="float16",
    bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False, hidden_act="silu",
)


# ---- configuration -----------------------------------------------------------------------------

def model_config(layers: int = LAYERS, input_len: int = INPUT_LEN, output_len: int = OUTPUT_LEN) -> dict:
    """Llama-3-8B's shape with `layers` decoder layers, positions enough for the requests."""
    return dict(MODEL, num_hidden_layers=layers,
                max_position_embeddings=max(MODEL["max_position_embeddings"], input_len + output_len + 8))


def parse_method(spec: str) -> tuple[str, str | None]:
    """"awq_marlin:machete" -> ("awq_marlin", "machete"); "awq_marlin" -> ("awq_marlin", None): vLLM's pick."""
    quantization, _, backend = spec.strip().partition(":")
    if not quantization:
        raise ValueError(f"empty method in {spec!r}")
    backend = backend.strip().lower().replace("-", "_") or None
    if backend == "auto":
        backend = None
    if quantization == OURS and backend:
        raise ValueError(f"{OURS} runs TurboMind's kernels: no --linear-backend for it ({spec!r})")
    return quantization, backend


def label(quantization: str, backend: str | None) -> str:
    return f"{quantization}:{backend}" if backend else quantization


def methods(text: str) -> list[str]:
    """--methods as canonical labels, in order, each once."""
    out = []
    for spec in filter(None, (s.strip() for s in text.split(","))):
        name = label(*parse_method(spec))
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError("--methods names no method")
    return out


def is_default(args: argparse.Namespace) -> bool:
    return (args.layers, args.prompts, args.input_len, args.output_len) == (LAYERS, PROMPTS, INPUT_LEN, OUTPUT_LEN)


def config_name(args: argparse.Namespace) -> str:
    return f"llama3-8b-{args.layers}l-{args.prompts}x{args.input_len}-{args.output_len}"


def result_paths(args: argparse.Namespace, gpu: str | None = None) -> tuple[Path, Path]:
    """(the results' path without extension, the children's log folder): the headline benchmarks/results/awq for
    the default configuration, benchmarks/results/awq/<gpu>-<what> otherwise; --out overrides both."""
    if args.out:
        stem = common.stem_of(args.out)
        return stem, stem
    logs = common.result_stem(NAME, config_name(args), gpu)
    return (common.RESULTS / NAME if is_default(args) else logs), logs


def default_checkpoint(layers: int) -> Path:
    return Path(tempfile.gettempdir()) / "turboquant-awq-bench" / f"llama3-8b-{layers}l-g{GROUP}"


def llm_kwargs(quantization: str, backend: str | None, model_dir: str, input_len: int, output_len: int,
               gpu_memory_utilization: float) -> dict:
    """LLM(...) of a row: the checkpoint in fp16, no tokenizer, no prefix caching, vLLM's default compilation and
    CUDA graphs (awq_turbomind: compiled, no graphs, which it refuses), --linear-backend where the row names one."""
    kwargs = dict(model=model_dir, quantization=quantization, dtype="float16", skip_tokenizer_init=True, seed=0,
                  max_model_len=input_len + output_len + 8, gpu_memory_utilization=gpu_memory_utilization,
                  enable_prefix_caching=False)
    if backend:
        kwargs["linear_backend"] = backend
    if quantization == "awq_turbomind":
        kwargs["compilation_config"] = {"cudagraph_mode": "NONE"}
    return kwargs


def child_command(spec: str, model_dir: str | Path, args: argparse.Namespace) -> list[str]:
    """The process measuring one row: python -m benchmarks.awq ... --child <row> --checkpoint <dir>."""
    return common.module_command(
        NAME, "--prompts", str(args.prompts), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--layers", str(args.layers), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--seed", str(args.seed), "--checkpoint", str(model_dir), "--child", spec)


# ---- the checkpoint ----------------------------------------------------------------------------

def ensure_checkpoint(model: dict, path: Path) -> Path:
    """The random AWQ checkpoint of `model` at path: reused when its config.json is the one this model writes,
    written otherwise (into a scratch folder renamed at the end, so a cut-off write is never reused)."""
    from turboquant_vllm.quant.awq_turbomind import checkpoint

    want = dict(model, torch_dtype="float16", quantization_config=checkpoint.quantization_config(GROUP))
    config = path / "config.json"
    if config.exists() and (path / "model.safetensors").exists() and json.loads(config.read_text()) == want:
        print(f"checkpoint: reusing {path}", flush=True)
        return path
    scratch = path.parent / f"{path.name}.partial-{os.getpid()}"
    t = time.perf_counter()
    checkpoint.random_checkpoint(model, scratch, group_size=GROUP)
    if path.exists():
        import shutil

        shutil.rmtree(path)
    os.replace(scratch, path)
    print(f"checkpoint: wrote {path} in {time.perf_counter() - t:.0f} s", flush=True)
    return path


# ---- the child: one engine, one row ------------------------------------------------------------

def engine(spec: str, model_dir: str, prompts: int, input_len: int, output_len: int, gpu_memory_utilization: float,
           seed: int = 0) -> dict:
    """Runs inside a fresh process: one engine, throughput and batch-1 decode latency."""
    import random
    import statistics

    quantization, backend = parse_method(spec)
    if quantization == OURS:  # the entry point registers it once installed; a source tree may lack the entry point
        from turboquant_vllm.quant.awq_turbomind import register

        register()
    from vllm import LLM, SamplingParams

    llm = LLM(**llm_kwargs(quantization, backend, model_dir, input_len, output_len, gpu_memory_utilization))
    config = llm.llm_engine.vllm_config
    cache, sched = config.cache_config, config.scheduler_config
    row = dict(method=quantization, linear_backend=backend or "auto", label=spec,
               kv_cache_tokens=(cache.num_gpu_blocks or 0) * cache.block_size, max_num_seqs=sched.max_num_seqs,
               max_num_batched_tokens=sched.max_num_batched_tokens,
               cudagraph_mode=str(config.compilation_config.cudagraph_mode))
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)

    def random_prompts(n: int) -> list[dict]:
        return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(input_len)]} for _ in range(n)]

    def params(max_tokens: int):
        return SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                              detokenize=False)

    def generate(batch: list[dict], max_tokens: int) -> tuple[float, int]:
        t = time.perf_counter()
        outs = llm.generate(batch, params(max_tokens), use_tqdm=False)
        seconds = time.perf_counter() - t
        return seconds, sum(len(o.outputs[0].token_ids) for o in outs)

    # Warm-up: a few requests through prefill and decode, and one alone, so no first-time path lands in a timed run.
    generate(random_prompts(WARMUP_PROMPTS), output_len)
    one = random_prompts(1)
    generate(one, output_len)
    seconds, tokens = generate(random_prompts(prompts), output_len)
    assert tokens == prompts * output_len, (tokens, prompts * output_len)
    row.update(prompts=prompts, input_len=input_len, output_len=output_len, seconds=seconds, output_tokens=tokens,
               output_tok_s=tokens / seconds, total_tok_s=prompts * (input_len + output_len) / seconds,
               requests_s=prompts / seconds)
    pairs = [(generate(one, 1)[0], generate(one, output_len)[0]) for _ in range(LATENCY_REPEATS)]
    row["decode_latency_ms"] = statistics.median(1000 * (full - first) / (output_len - 1) for first, full in pairs)
    row["first_token_ms"] = statistics.median(1000 * first for first, _ in pairs)
    row["latency_pairs_s"] = pairs
    return row


# ---- the parent: the children and their logs ---------------------------------------------------

KERNEL_PATTERNS = (
    (re.compile(r"Using (\w+) for AutoAWQMarlinLinearMethod"), "{0}"),
    (re.compile(r"on the GEMM kernels of turbomind (\S+)"), "turbomind {0}"),
    (re.compile(r"Falling back to unoptimized AWQ kernels"), "AutoAWQLinearMethod (Triton)"),
)
FACT_PATTERNS = {
    "weights_gib": re.compile(r"Model loading took ([\d.]+) GiB"),
    "kv_cache_gib": re.compile(r"Available KV cache memory: ([\d.]+) GiB"),
}
ERROR = re.compile(r"\b([A-Za-z_][\w.]*(?:Error|Exception)): (.+)")


def log_facts(text: str) -> dict:
    """What a child's log says: the kernels its linear layers run ("kernel": those named, in order, joined by " + "),
    the weights' and KV cache's GiB, and the last error line."""
    kernels: list[str] = []
    for line in text.splitlines():
        for pattern, fmt in KERNEL_PATTERNS:
            m = pattern.search(line)
            if m and fmt.format(*m.groups()) not in kernels:
                kernels.append(fmt.format(*m.groups()))
    facts: dict = {"kernel": " + ".join(kernels) or None}
    for key, pattern in FACT_PATTERNS.items():
        found = pattern.findall(text)
        facts[key] = float(found[-1]) if found else None
    errors = [m.group(0).strip() for m in map(ERROR.search, text.splitlines()) if m]
    facts["error"] = errors[-1][:500] if errors else None
    return facts


def run_child(cmd: list[str], env: dict, log: Path, timeout: float | None) -> tuple[dict | None, str, str | None]:
    """One row's process: (its row or None, its output, why it failed or None). The child leads a process group of
    its own, so a timed-out child goes with its engine processes."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    why = None
    try:
        out, err = proc.communicate(timeout=timeout or None)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        why = f"timed out after {timeout:.0f} s"
    text = (out or "") + (err or "")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text((out or "")[-40000:] + "\n---- stderr ----\n" + (err or "")[-40000:])
    found = [line for line in (out or "").splitlines() if line.startswith(TAG + " ")]
    if found and why is None:
        return json.loads(found[-1][len(TAG) + 1:]), text, None
    return None, text, why or f"exit status {proc.returncode}"


def measure(spec: str, cmd: list[str], log: Path, timeout: float | None, command: str) -> dict:
    """A row: the child's measurements with what its log names, or the error that stopped it."""
    quantization, backend = parse_method(spec)
    row, text, why = run_child(cmd, common.child_env(), log, timeout)
    facts = log_facts(text)
    if row is None:
        row = dict(method=quantization, linear_backend=backend or "auto", label=spec, output_tok_s=None,
                   decode_latency_ms=None, error=f"{why}: {facts['error']}" if facts["error"] else why)
    row["kernel"] = facts["kernel"] or row.get("kernel")
    row.update({k: v for k, v in facts.items() if k not in ("kernel", "error") and v is not None})
    row["command"] = command
    row["log"] = str(log)
    return row


# ---- results -----------------------------------------------------------------------------------

def order(row: dict) -> int:
    """Rows in the order of the default --methods, others after them."""
    default = METHODS.split(",")
    return default.index(row.get("label")) if row.get("label") in default else len(default)


def ok(row: dict) -> bool:
    return not row.get("error") and row.get("output_tok_s") is not None


def add_ratios(rows: list[dict]) -> tuple[dict | None, dict | None]:
    """Each row against vLLM's best kernel: output_tok_s_vs_best_vllm (its tok/s / the best vLLM row's) and
    decode_speed_vs_best_vllm (the best vLLM latency / its own): > 1 is faster. Returns the two best vLLM rows."""
    vllm_rows = [r for r in rows if ok(r) and r["method"] != OURS]
    best_tput = max(vllm_rows, key=lambda r: r["output_tok_s"], default=None)
    timed = [r for r in vllm_rows if r.get("decode_latency_ms")]
    best_lat = min(timed, key=lambda r: r["decode_latency_ms"], default=None)
    for r in rows:
        good = ok(r)
        r["output_tok_s_vs_best_vllm"] = r["output_tok_s"] / best_tput["output_tok_s"] if good and best_tput else None
        r["decode_speed_vs_best_vllm"] = (best_lat["decode_latency_ms"] / r["decode_latency_ms"]
                                          if good and best_lat and r.get("decode_latency_ms") else None)
    return best_tput, best_lat


def fmt(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def markdown(rows: list[dict], model: dict, settings: dict) -> str:
    best_tput, best_lat = add_ratios(rows)
    lines = ["| method | --linear-backend | kernel | output tok/s | vs best vLLM | batch-1 decode ms/token "
             "| decode speed vs best vLLM | CUDA graphs | KV cache tokens | weights GiB |",
             "| --- " * 10 + "|"]
    for r in rows:
        kernel = r.get("kernel") or ""
        if r.get("error"):
            kernel = f"{kernel} **failed**: {r['error']}".strip().replace("|", "\\|").replace("\n", " ")
        vs = lambda key: f"{r[key]:.2f}x" if r.get(key) is not None else ""  # noqa: E731
        lines.append(f"| {r['method']} | {r.get('linear_backend') or 'auto'} | {kernel} | "
                     f"{fmt(r.get('output_tok_s'), ',.0f')} | {vs('output_tok_s_vs_best_vllm')} | "
                     f"{fmt(r.get('decode_latency_ms'), '.2f')} | {vs('decode_speed_vs_best_vllm')} | "
                     f"{(r.get('cudagraph_mode') or '').lower()} | {fmt(r.get('kv_cache_tokens'), ',')} | "
                     f"{fmt(r.get('weights_gib'), '.2f')} |")
    shape = (f"{model['num_hidden_layers']} layers, hidden {model['hidden_size']}, intermediate "
             f"{model['intermediate_size']}, {model['num_attention_heads']} q / {model['num_key_value_heads']} KV "
             f"heads, head_dim {model['head_dim']}, vocab {model['vocab_size']}")
    best = []
    if best_tput:
        best.append(f"best vLLM throughput: {best_tput['label']} ({best_tput.get('kernel')})")
    if best_lat:
        best.append(f"best vLLM batch-1 decode: {best_lat['label']} ({best_lat.get('kernel')})")
    runs_by: dict = {}  # rows merged from earlier calls (--merge) name the command that measured them
    for r in rows:
        runs_by.setdefault(r.get("command", "unrecorded"), []).append(r["label"])
    measured = "\n".join(f"- {', '.join(labels)}: `{cmd}`" for cmd, labels in runs_by.items())
    return (f"AWQ int4 (group {GROUP}, random codes, fp16) in vLLM end to end, Llama-3-8B shape: {shape}.\n\n"
            + "\n".join(lines)
            + f"\n\nOutput tok/s: {settings['prompts']} requests of {settings['input_len']} prompt tokens generating "
            f"{settings['output_len']} each, one llm.generate (vLLM's default scheduling, CUDA graphs as the column "
            f"says, no prefix caching, gpu_memory_utilization {settings['gpu_memory_utilization']}). Batch-1 decode "
            f"ms/token: (one request generating {settings['output_len']} tokens - the same generating 1) / "
            f"{settings['output_len'] - 1}, median of {LATENCY_REPEATS}. Ratios: against the best vLLM kernel, > 1 "
            f"faster" + (f" ({'; '.join(best)})" if best else "") + ". Kernel: the one the engine's log names."
            + f"\n\nMeasured by:\n{measured}\n")


def plot(path: Path, rows: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["label"] + ("\n" + r["kernel"].replace("LinearKernel", "") if r.get("kernel") else "") for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 2.4 * len(rows)), 4.8))
    for ax, key, what in zip(axes, ("output_tok_s", "decode_latency_ms"),
                             ("output tok/s (higher is better)", "batch-1 decode ms/token (lower is better)")):
        ys = [r.get(key) if ok(r) and r.get(key) is not None else 0.0 for r in rows]
        bars = ax.bar(range(len(rows)), ys, color=["tab:orange" if r["method"] == OURS else "tab:blue" for r in rows])
        for bar, r in zip(bars, rows):
            text = "failed" if not ok(r) else (f"{r[key]:,.0f}" if key == "output_tok_s" else f"{r[key]:.2f}")
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8, color="red" if not ok(r) else "black")
        ax.set_xticks(range(len(rows)), names, fontsize=7)
        ax.set_title(what)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(rows: list[dict], stem: Path, model: dict, settings: dict, provenance: dict | None = None) -> None:
    """stem.json ({"meta", "rows"}: rows with method, kernel, output_tok_s, decode_latency_ms, ...), stem.md (the
    table, ratios vs the best vLLM kernel, failed rows with their error), stem.png (bars)."""
    provenance = provenance or common.provenance(common.command_line(NAME, []))
    text = markdown(rows, model, settings)  # adds the ratios to the rows
    common.write_json(common.with_ext(stem, ".json"), dict(meta=dict(model=model, group_size=GROUP, **settings),
                                                           rows=rows), provenance)
    common.write_markdown(common.with_ext(stem, ".md"), text, provenance)
    plot(common.with_ext(stem, ".png"), rows, f"AWQ int4 in vLLM, Llama-3-8B shape ({model['num_hidden_layers']} "
         f"layers): {settings['prompts']} x {settings['input_len']} in / {settings['output_len']} out")
    print(text, flush=True)


# ---- the command line --------------------------------------------------------------------------

def arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--methods", default=METHODS, help="<quantization>[:<linear backend>],... (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=PROMPTS)
    ap.add_argument("--input-len", type=int, default=INPUT_LEN)
    ap.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    ap.add_argument("--layers", type=int, default=LAYERS, help="decoder layers of the Llama-3-8B shape")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--seed", type=int, default=0, help="of the prompts' random token ids")
    ap.add_argument("--checkpoint", type=Path, help="the random AWQ checkpoint's folder (written if absent or of "
                    "another shape; default <tmp>/turboquant-awq-bench/llama3-8b-<layers>l-g128)")
    ap.add_argument("--timeout", type=float, default=0, help="seconds a row may take before it is stopped and "
                    "written as failed (0: no limit)")
    common.add_out_argument(ap, "benchmarks/results/awq (default configuration), benchmarks/results/awq/<gpu>-<what>")
    ap.add_argument("--merge", action="store_true", help="keep rows of other methods already in the results")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        args.method_list = methods(args.methods)
    except ValueError as e:
        ap.error(str(e))
    if args.output_len < 2:
        ap.error("--output-len must be 2 or more (decode latency takes the difference to a 1-token run)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    if args.child:
        row = engine(args.child, str(args.checkpoint), args.prompts, args.input_len, args.output_len,
                     args.gpu_memory_utilization, args.seed)
        print(f"{TAG} " + json.dumps(row), flush=True)
        return
    model = model_config(args.layers, args.input_len, args.output_len)
    settings = dict(prompts=args.prompts, input_len=args.input_len, output_len=args.output_len,
                    gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed)
    stem, logs = result_paths(args)
    command = common.command_line(NAME, argv)
    provenance = common.provenance(command)
    rows: list[dict] = []
    found = common.with_ext(stem, ".json")
    if args.merge and found.exists():  # keep the other methods' rows of an earlier call
        rows = [r for r in json.loads(found.read_text())["rows"] if r.get("label") not in args.method_list]
    model_dir = ensure_checkpoint(model, args.checkpoint or default_checkpoint(args.layers))
    for spec in args.method_list:
        log = logs / f"{spec.replace(':', '-')}.log"
        row = measure(spec, child_command(spec, model_dir, args), log, args.timeout, command)
        rows = sorted(rows + [row], key=order)
        print({k: v for k, v in row.items() if k != "latency_pairs_s"}, flush=True)
        write(rows, stem, model, settings, provenance)  # after every row: a cut-off run keeps what it measured
    if not any(ok(r) for r in rows):
        print("no row measured; see the logs in", logs, flush=True)
    print(f"wrote {stem}.json / .md / .png", flush=True)


if __name__ == "__main__":
    main()
