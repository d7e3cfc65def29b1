"""The runner of the benchmarks whose rows are whole vLLM engines, one child process per row (awq, weights): the
rows' command line, the child timing one engine (throughput and batch-1 decode latency), the parent running the
children and reading their logs, the results written after every row (JSON, Markdown tables, bar plots), and
WeightRows, the benchmark of them that awq and weights subclass; the serving benchmarks (serving_soak) use its helpers
too. Like benchmarks.common, it imports neither torch nor vLLM at import time.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, ContextManager, Iterable, Iterator

from .common import (RESULTS, add_out_argument, child_env, command_line, module_command, parser, provenance,
                     result_stem, stem_of, with_ext, write_json, write_markdown)


# ---- end-to-end rows in vLLM: one engine per row, in a child process each (awq, weights) ---------------
#
# A benchmark of this kind names its rows (--methods), runs each in a fresh process (vLLM engines do not tear down
# cleanly in one) that builds one LLM and times it (time_requests): output tok/s = output tokens / wall time of one
# llm.generate over --prompts requests of --input-len random prompt token ids generating --output-len each (greedy,
# ignore_eos, after a warm-up generate), the median of THROUGHPUT_REPEATS runs, each on fresh prompts; the same
# requests generating 1 token (prefill_s, the median of as many) split a run into its prefill and decode; batch-1
# decode latency = (time of one request generating --output-len tokens - time of the same request generating 1) /
# (--output-len - 1), the median of LATENCY_REPEATS pairs. The
# child prints its row as one `<TAG> <json>` line (emit_row); the parent (measure_row) adds what the child's log says
# (the kernel its linear layers run, the weights' and KV cache's GiB, the last error), writes the log, and stops a
# child past --timeout with its engine processes. run_rows writes the results after every row, so a cut-off run
# keeps what it measured; --merge keeps an earlier call's rows of other methods (merged_rows). The tables, ratio
# columns and bar plots are built here too. torch and vLLM are imported only inside the child's functions.

ROW_PROMPTS, ROW_INPUT_LEN, ROW_OUTPUT_LEN, ROW_LAYERS = 1000, 1024, 128, 32
ROWS_MODEL = "llama3-8b"  # the model those defaults are of, first in the result names
LATENCY_REPEATS = 3
THROUGHPUT_REPEATS = 3
WARMUP_PROMPTS = 16
LOG_FACT_PATTERNS = {
    "weights_gib": re.compile(r"Model loading took ([\d.]+) GiB"),
    "kv_cache_gib": re.compile(r"Available KV cache memory: ([\d.]+) GiB"),
}
LOG_ERROR = re.compile(r"\b([A-Za-z_][\w.]*(?:Error|Exception)): (.+)")
# Llama-3-8B's shape (config.json of meta-llama/Meta-Llama-3-8B; torch_dtype as each benchmark runs it)
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=ROW_LAYERS, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, torch_dtype="bfloat16",
    bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False, hidden_act="silu",
)


# ---- rows: configuration and the command line -------------------------------------------------

def llama3_8b(base: dict, layers: int = ROW_LAYERS, input_len: int = ROW_INPUT_LEN,
              output_len: int = ROW_OUTPUT_LEN) -> dict:
    """base (LLAMA3_8B or a variant of it) with `layers` decoder layers, positions enough for the requests."""
    return dict(base, num_hidden_layers=layers,
                max_position_embeddings=max(base["max_position_embeddings"], input_len + output_len + 8))


def add_row_arguments(ap: argparse.ArgumentParser, name: str,
                      layers_help: str = "decoder layers of the Llama-3-8B shape") -> None:
    """The options every such benchmark takes: the requests, the model's depth, the engine's memory, --timeout,
    --out (default: the headline benchmarks/results/<name> for the default configuration, else
    benchmarks/results/<name>/<gpu>-<what>), --merge, and the child's hidden --child."""
    ap.add_argument("--prompts", type=int, default=ROW_PROMPTS)
    ap.add_argument("--input-len", type=int, default=ROW_INPUT_LEN)
    ap.add_argument("--output-len", type=int, default=ROW_OUTPUT_LEN)
    ap.add_argument("--layers", type=int, default=ROW_LAYERS, help=layers_help)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size: each row's engine over this many GPUs")
    ap.add_argument("--seed", type=int, default=0, help="of the prompts' random token ids")
    ap.add_argument("--timeout", type=float, default=0, help="seconds a row may take before it is stopped and "
                    "written as failed (0: no limit)")
    add_out_argument(ap, f"benchmarks/results/{name} (default configuration), benchmarks/results/{name}/<gpu>-<what>")
    ap.add_argument("--merge", action="store_true", help="keep rows of other methods already in the results")
    ap.add_argument("--child", help=argparse.SUPPRESS)


def check_row_arguments(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.output_len < 2:
        ap.error("--output-len must be 2 or more (decode latency takes the difference to a 1-token run)")
    if args.tp < 1:
        ap.error("--tp must be 1 or more")


def row_settings(args: argparse.Namespace) -> dict:
    """The requests' configuration, as the results' meta records it (the tensor-parallel size where above 1)."""
    return dict(prompts=args.prompts, input_len=args.input_len, output_len=args.output_len,
                gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed,
                **({"tensor_parallel_size": args.tp} if args.tp > 1 else {}))


def row_child_arguments(args: argparse.Namespace) -> list[str]:
    """The options a row's child is started with: those add_row_arguments names but the parent's own (--timeout,
    --out, --merge)."""
    return ["--prompts", str(args.prompts), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--layers", str(args.layers), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
            "--seed", str(args.seed), *(["--tp", str(args.tp)] if args.tp > 1 else [])]


def is_default_rows(args: argparse.Namespace) -> bool:
    return ((args.layers, args.prompts, args.input_len, args.output_len, args.tp)
            == (ROW_LAYERS, ROW_PROMPTS, ROW_INPUT_LEN, ROW_OUTPUT_LEN, 1))


def rows_config_name(args: argparse.Namespace, model: str = ROWS_MODEL) -> str:
    return (f"{model}-{args.layers}l-{args.prompts}x{args.input_len}-{args.output_len}"
            + (f"-tp{args.tp}" if args.tp > 1 else ""))


def rows_result_paths(name: str, args: argparse.Namespace, gpu: str | None = None,
                      model: str = ROWS_MODEL) -> tuple[Path, Path]:
    """(the results' path without extension, the children's log folder): the headline benchmarks/results/<name>
    for the default configuration (of the Llama-3-8B shape, ROWS_MODEL), benchmarks/results/<name>/<gpu>-<what>
    otherwise (<what> names `model` first); --out overrides both."""
    if args.out:
        stem = stem_of(args.out)
        return stem, stem
    logs = result_stem(name, rows_config_name(args, model), gpu)
    return (RESULTS / name if model == ROWS_MODEL and is_default_rows(args) else logs), logs


# ---- rows: the child, one engine, one row ---------------------------------------------------------

def engine_facts(llm) -> dict:
    """What shapes the engine's steps and memory: KV cache tokens, scheduler limits, CUDA-graph mode."""
    config = llm.llm_engine.vllm_config
    cache, sched = config.cache_config, config.scheduler_config
    return dict(kv_cache_tokens=(cache.num_gpu_blocks or 0) * cache.block_size, max_num_seqs=sched.max_num_seqs,
                max_num_batched_tokens=sched.max_num_batched_tokens,
                cudagraph_mode=str(config.compilation_config.cudagraph_mode),
                tensor_parallel_size=config.parallel_config.tensor_parallel_size)


def time_requests(llm, vocab: int, prompts: int, input_len: int, output_len: int, seed: int = 0) -> dict:
    """Throughput of `prompts` random requests and batch-1 decode latency on a built engine, as this section says."""
    import random
    import statistics

    from vllm import SamplingParams

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
    runs = []
    for _ in range(THROUGHPUT_REPEATS):
        run_seconds, tokens = generate(random_prompts(prompts), output_len)
        assert tokens == prompts * output_len, (tokens, prompts * output_len)
        runs.append(run_seconds)
    prefills = [generate(random_prompts(prompts), 1)[0] for _ in range(THROUGHPUT_REPEATS)]
    seconds = statistics.median(runs)
    row = dict(prompts=prompts, input_len=input_len, output_len=output_len, seconds=seconds, output_tokens=tokens,
               output_tok_s=tokens / seconds, total_tok_s=prompts * (input_len + output_len) / seconds,
               requests_s=prompts / seconds, runs_s=runs, prefill_s=statistics.median(prefills),
               prefill_runs_s=prefills)
    pairs = [(generate(one, 1)[0], generate(one, output_len)[0]) for _ in range(LATENCY_REPEATS)]
    row["decode_latency_ms"] = statistics.median(1000 * (full - first) / (output_len - 1) for first, full in pairs)
    row["first_token_ms"] = statistics.median(1000 * first for first, _ in pairs)
    row["latency_pairs_s"] = pairs
    return row


def emit_row(tag: str, row: dict) -> None:
    """The child's result, the one line its parent reads back."""
    print(f"{tag} " + json.dumps(row), flush=True)


# ---- rows: the parent, the children and their logs ----------------------------------------------

KernelPatterns = Iterable[tuple[re.Pattern, str]]


def log_facts(text: str, kernel_patterns: KernelPatterns) -> dict:
    """What a child's log says: the kernels its linear layers run ("kernel": each pattern's format of its groups,
    those found in order of the log, joined by " + "), the weights' and KV cache's GiB, and the last error line."""
    kernels: list[str] = []
    patterns = list(kernel_patterns)
    for line in text.splitlines():
        for pattern, fmt in patterns:
            m = pattern.search(line)
            if m and fmt.format(*m.groups()) not in kernels:
                kernels.append(fmt.format(*m.groups()))
    facts: dict = {"kernel": " + ".join(kernels) or None}
    for key, pattern in LOG_FACT_PATTERNS.items():
        found = pattern.findall(text)
        facts[key] = float(found[-1]) if found else None
    errors = [m.group(0).strip() for m in map(LOG_ERROR.search, text.splitlines()) if m]
    facts["error"] = errors[-1][:500] if errors else None
    return facts


def run_child(cmd: list[str], env: dict, log: Path, timeout: float | None, tag: str
              ) -> tuple[dict | None, str, str | None]:
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
    found = [line for line in (out or "").splitlines() if line.startswith(tag + " ")]
    if found and why is None:
        return json.loads(found[-1][len(tag) + 1:]), text, None
    return None, text, why or f"exit status {proc.returncode}"


def measure_row(cmd: list[str], log: Path, timeout: float | None, command: str, identity: dict, tag: str,
            kernel_patterns: KernelPatterns, env: dict) -> dict:
    """A row: the child's measurements with what its log names, or `identity` (the row's method, label, ...) with
    the error that stopped it. "kernel": the log's, else the child's own."""
    row, text, why = run_child(cmd, env, log, timeout, tag)
    facts = log_facts(text, kernel_patterns)
    if row is None:
        row = dict(identity, output_tok_s=None, decode_latency_ms=None,
                   error=f"{why}: {facts['error']}" if facts["error"] else why)
    row["kernel"] = facts["kernel"] or row.get("kernel")
    row.update({k: v for k, v in facts.items() if k not in ("kernel", "error") and v is not None})
    row["command"] = command
    row["log"] = str(log)
    return row


def row_log_name(label: str) -> str:
    """A row's log file name: awq_marlin:machete -> awq_marlin-machete.log."""
    return f"{label.replace(':', '-')}.log"


def run_rows(labels: list[str], rows: list[dict], logs: Path, measure_one: Callable[[str, Path], dict],
             write_rows: Callable[[list[dict]], None], order: Callable[[dict], int]) -> list[dict]:
    """Each row measured in turn (measure_one(label, its log path)) beside `rows` (merged from an earlier call),
    kept in `order`, and written after every one (write_rows): a cut-off run keeps what it measured."""
    for label in labels:
        row = measure_one(label, logs / row_log_name(label))
        rows = sorted(rows + [row], key=order)
        print({k: v for k, v in row.items() if k != "latency_pairs_s"}, flush=True)
        write_rows(rows)
    if not any(row_ok(r) for r in rows):
        print("no row measured; see the logs in", logs, flush=True)
    return rows


def merged_rows(found: Path, labels: list[str]) -> list[dict]:
    """--merge: the rows of an earlier call's results (found, a .json) but those this call measures again."""
    if not found.exists():
        return []
    return [r for r in json.loads(found.read_text())["rows"] if r.get("label") not in labels]


# ---- rows: results -----------------------------------------------------------------------------

def row_ok(row: dict) -> bool:
    return not row.get("error") and row.get("output_tok_s") is not None


def add_row_ratios(rows: list[dict], tput_ref: dict | None, lat_ref: dict | None, suffix: str) -> None:
    """output_tok_s_vs_<suffix> (a row's tok/s / tput_ref's) and decode_speed_vs_<suffix> (lat_ref's batch-1 decode
    latency / the row's own): > 1 is faster; None for failed rows or without a reference."""
    for r in rows:
        good = row_ok(r)
        r[f"output_tok_s_vs_{suffix}"] = (r["output_tok_s"] / tput_ref["output_tok_s"]
                                          if good and tput_ref else None)
        r[f"decode_speed_vs_{suffix}"] = (lat_ref["decode_latency_ms"] / r["decode_latency_ms"]
                                          if good and lat_ref and r.get("decode_latency_ms") else None)


def fmt(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def ratio_cell(row: dict, key: str) -> str:
    return f"{row[key]:.2f}x" if row.get(key) is not None else ""


def kernel_cell(row: dict) -> str:
    """The kernel, and for a failed row its error (escaped for a Markdown table)."""
    kernel = row.get("kernel") or ""
    if row.get("error"):
        kernel = f"{kernel} **failed**: {row['error']}".strip().replace("|", "\\|").replace("\n", " ")
    return kernel


def markdown_table(rows: list[dict], columns: list[tuple[str, Callable[[dict], str]]]) -> str:
    """A Markdown table: one column per (header, cell of a row)."""
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "| --- " * len(columns) + "|"]
    lines += ["| " + " | ".join(cell(r) for _, cell in columns) + " |" for r in rows]
    return "\n".join(lines)


def shape_text(model: dict) -> str:
    return (f"{model['num_hidden_layers']} layers, hidden {model['hidden_size']}, intermediate "
            f"{model['intermediate_size']}, {model['num_attention_heads']} q / {model['num_key_value_heads']} KV "
            f"heads, head_dim {model['head_dim']}, vocab {model['vocab_size']}")


def run_split_cell(row: dict) -> str:
    """The throughput run's median seconds = its prefill (the requests generating 1 token) + the rest."""
    if row.get("prefill_s") is None:
        return ""
    return f"{row['seconds']:.3f} = {row['prefill_s']:.3f} + {row['seconds'] - row['prefill_s']:.3f}"


def timing_text(settings: dict) -> str:
    """How the two speed columns were measured."""
    return (f"Output tok/s: {settings['prompts']} requests of {settings['input_len']} prompt tokens generating "
            f"{settings['output_len']} each, one llm.generate (vLLM's default scheduling, CUDA graphs as the column "
            f"says, no prefix caching, gpu_memory_utilization {settings['gpu_memory_utilization']}), the median of "
            f"{THROUGHPUT_REPEATS} runs on fresh prompts (one run in rows without a run's split); run s = prefill + "
            f"decode: the run's median seconds, the same requests generating 1 token, the rest. Batch-1 decode "
            f"ms/token: (one request generating {settings['output_len']} tokens - the same generating 1) / "
            f"{settings['output_len'] - 1}, median of {LATENCY_REPEATS}."
            + (f" Tensor parallel {settings['tensor_parallel_size']}: each engine over that many GPUs."
               if settings.get("tensor_parallel_size", 1) > 1 else ""))


def measured_by(rows: list[dict]) -> str:
    """Rows merged from earlier calls (--merge) name the command that measured them: one line per command."""
    runs_by: dict = {}
    for r in rows:
        runs_by.setdefault(r.get("command", "unrecorded"), []).append(r["label"])
    return "\n".join(f"- {', '.join(labels)}: `{cmd}`" for cmd, labels in runs_by.items())


def rows_plot(path: Path, rows: list[dict], title: str, ours: Callable[[dict], bool],
         kernel_label: Callable[[str], str] = lambda k: k) -> None:
    """Two bar charts, output tok/s and batch-1 decode ms/token, one bar per row (ours in orange, failed at 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["label"] + ("\n" + kernel_label(r["kernel"]) if r.get("kernel") else "") for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 2.4 * len(rows)), 4.8))
    for ax, key, what in zip(axes, ("output_tok_s", "decode_latency_ms"),
                             ("output tok/s (higher is better)", "batch-1 decode ms/token (lower is better)")):
        ys = [r.get(key) if row_ok(r) and r.get(key) is not None else 0.0 for r in rows]
        bars = ax.bar(range(len(rows)), ys, color=["tab:orange" if ours(r) else "tab:blue" for r in rows])
        for bar, r in zip(bars, rows):
            text = "failed" if not row_ok(r) else (f"{r[key]:,.0f}" if key == "output_tok_s" else f"{r[key]:.2f}")
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8, color="red" if not row_ok(r) else "black")
        ax.set_xticks(range(len(rows)), names, fontsize=7)
        ax.set_title(what)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- rows: one benchmark of them (awq, weights) -------------------------------------------------------------------

class WeightRows(abc.ABC):
    """A benchmark of end-to-end rows in vLLM, one weight quantization per row (--methods: <method>[:<variant>]): its
    command line, the child measuring one row, the parent running the children, the results (.json, .md, .png). A
    subclass (awq, weights) says what differs with its kind of row: the attributes below, the abstract hooks, and the
    hooks with a default that it overrides. --help is the subclass's module's docstring."""

    name: str  # python -m benchmarks <name>, benchmarks/results/<name>
    tag: str  # the child's result line: <tag> <json>
    kernel_patterns: KernelPatterns  # the log lines naming the kernel (log_facts)
    order_labels: tuple[str, ...]  # rows in this order, others after
    ours: str  # the method whose bars are orange
    dtype: str  # the engine's
    meta_extra: dict  # what the results' meta records besides the model and the settings
    variant_column: tuple[str, Callable[[dict], str]]  # the table's second column: its header, a row's cell
    versus: tuple[str, str]  # the ratios' reference: as the table's headers name it, as the rows' keys end

    # ---- hooks: the command line and the model

    @staticmethod
    @abc.abstractmethod
    def parse_method(spec: str) -> tuple[str, str | None]:
        """A --methods entry -> (method, variant; None: the method's default)."""

    @abc.abstractmethod
    def identity(self, spec: str) -> dict:
        """A row's method, variant and label: what its child's row starts with, all that a failed row has."""

    @abc.abstractmethod
    def add_arguments(self, ap: argparse.ArgumentParser) -> None:
        """--methods, add_row_arguments and the kind's own options."""

    def defaults(self, args: argparse.Namespace) -> dict:
        """Defaults that depend on other options, for those left None."""
        return {}

    def check_arguments(self, ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        """The kind's own checks, after the common ones."""

    @abc.abstractmethod
    def model(self, args: argparse.Namespace) -> dict:
        """The config.json the rows run."""

    def model_name(self, args: argparse.Namespace) -> str:
        """The model first in the result names."""
        return ROWS_MODEL

    def settings(self, args: argparse.Namespace) -> dict:
        """The requests' configuration, as the results' meta records it."""
        return row_settings(args)

    # ---- hooks: the children

    @abc.abstractmethod
    def model_dirs(self, args: argparse.Namespace, model: dict) -> ContextManager[Callable[[str], Path]]:
        """While the rows run: a row's model folder."""

    @abc.abstractmethod
    def child_arguments(self, args: argparse.Namespace, model_dir: str | Path) -> list[str]:
        """The options telling a child its model (folder) beside the requests' options."""

    @abc.abstractmethod
    def child_model_dir(self, args: argparse.Namespace) -> Path:
        """The child's model folder, from those options."""

    @contextlib.contextmanager
    def environment(self, method: str, variant: str | None) -> Iterator[dict]:
        """A row's process's environment while it runs."""
        yield child_env()

    @abc.abstractmethod
    def prepare_child(self, method: str, variant: str | None, config: dict) -> None:
        """In the child, before vLLM builds the engine: the plugins the row needs."""

    def llm_kwargs(self, method: str, variant: str | None, model_dir: str, input_len: int, output_len: int,
                   gpu_memory_utilization: float) -> dict:
        """LLM(...) of a row: the model in the kind's dtype, no tokenizer, no prefix caching, vLLM's default
        compilation and CUDA graphs; a subclass adds the quantization."""
        return dict(model=model_dir, dtype=self.dtype, skip_tokenizer_init=True, seed=0,
                    max_model_len=input_len + output_len + 8, gpu_memory_utilization=gpu_memory_utilization,
                    enable_prefix_caching=False)

    def child_facts(self, method: str) -> dict:
        """What the child's row says that no log line does."""
        return {}

    # ---- hooks: the results

    @abc.abstractmethod
    def add_ratios(self, rows: list[dict]) -> str:
        """Adds the ratio columns' values to the rows (add_row_ratios); returns the sentences after the timing's: what
        the ratios are against, what the kernel and weights columns say."""

    @abc.abstractmethod
    def intro(self, rows: list[dict], model: dict) -> str:
        """The Markdown's first paragraph: what ran."""

    @abc.abstractmethod
    def plot_title(self, model: dict) -> str:
        """The plot's title, before its "(<layers> layers): <requests>"."""

    def kernel_label(self, kernel: str) -> str:
        """A kernel's name under its bar."""
        return kernel

    def summary_path(self, args: argparse.Namespace, stem: Path) -> Path | None:
        """A shorter results file written beside the results (write_summary); None: none."""
        return None

    def write_summary(self, path: Path, rows: list[dict]) -> None:
        """Writes summary_path's file, after every row."""
        raise NotImplementedError(f"{self.name} writes no summary")

    # ---- the command line

    def methods(self, text: str) -> list[str]:
        """--methods as canonical labels (<method>[:<variant>]), in order, each once."""
        out = []
        for spec in filter(None, (s.strip() for s in text.split(","))):
            method, variant = self.parse_method(spec)
            name = f"{method}:{variant}" if variant else method
            if name not in out:
                out.append(name)
        if not out:
            raise ValueError("--methods names no method")
        return out

    def arguments(self, argv: list[str] | None) -> argparse.Namespace:
        ap = parser(self.name, sys.modules[type(self).__module__].__doc__)
        self.add_arguments(ap)
        args = ap.parse_args(argv)
        for key, value in self.defaults(args).items():
            if getattr(args, key) is None:
                setattr(args, key, value)
        try:
            args.method_list = self.methods(args.methods)
        except ValueError as e:
            ap.error(str(e))
        check_row_arguments(ap, args)
        self.check_arguments(ap, args)
        return args

    def result_paths(self, args: argparse.Namespace, gpu: str | None = None) -> tuple[Path, Path]:
        """(the results' path without extension, the children's log folder): rows_result_paths."""
        return rows_result_paths(self.name, args, gpu, self.model_name(args))

    # ---- the child: one engine, one row

    def child_command(self, spec: str, model_dir: str | Path, args: argparse.Namespace) -> list[str]:
        """The process measuring one row: python -m benchmarks.<name> <the requests> <its model> --child <row>."""
        return module_command(self.name, *row_child_arguments(args), *self.child_arguments(args, model_dir),
                              "--child", spec)

    def engine(self, spec: str, model_dir: str, prompts: int, input_len: int, output_len: int,
               gpu_memory_utilization: float, seed: int = 0, tp: int = 1) -> dict:
        """Runs inside a fresh process: one engine, throughput and batch-1 decode latency (time_requests)."""
        method, variant = self.parse_method(spec)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.prepare_child(method, variant, config)
        from vllm import LLM

        kwargs = self.llm_kwargs(method, variant, model_dir, input_len, output_len, gpu_memory_utilization)
        llm = LLM(**kwargs, **({"tensor_parallel_size": tp} if tp > 1 else {}))
        row = dict(self.identity(spec), **engine_facts(llm), **self.child_facts(method))
        row.update(time_requests(llm, config["vocab_size"], prompts, input_len, output_len, seed))
        return row

    # ---- the parent: the children and their logs

    def log_facts(self, text: str) -> dict:
        """What a child's log says: log_facts with the kind's kernel patterns."""
        return log_facts(text, self.kernel_patterns)

    def measure(self, spec: str, cmd: list[str], log: Path, timeout: float | None, command: str) -> dict:
        """A row in its process (environment): the child's measurements with what its log names, or the error that
        stopped it."""
        with self.environment(*self.parse_method(spec)) as env:
            return measure_row(cmd, log, timeout, command, self.identity(spec), self.tag, self.kernel_patterns, env)

    # ---- results

    def order(self, row: dict) -> int:
        labels = self.order_labels
        return labels.index(row.get("label")) if row.get("label") in labels else len(labels)

    def markdown(self, rows: list[dict], model: dict, settings: dict) -> str:
        notes = self.add_ratios(rows)
        versus, key = self.versus
        columns = [
            ("method", lambda r: r["method"]),
            self.variant_column,
            ("kernel", kernel_cell),
            ("output tok/s", lambda r: fmt(r.get("output_tok_s"), ",.0f")),
            (f"vs {versus}", lambda r: ratio_cell(r, f"output_tok_s_vs_{key}")),
            ("run s = prefill + decode", run_split_cell),
            ("batch-1 decode ms/token", lambda r: fmt(r.get("decode_latency_ms"), ".2f")),
            (f"decode speed vs {versus}", lambda r: ratio_cell(r, f"decode_speed_vs_{key}")),
            ("CUDA graphs", lambda r: (r.get("cudagraph_mode") or "").lower()),
            ("KV cache tokens", lambda r: fmt(r.get("kv_cache_tokens"), ",")),
            ("weights GiB", lambda r: fmt(r.get("weights_gib"), ".2f")),
        ]
        return (self.intro(rows, model) + "\n\n" + markdown_table(rows, columns) + "\n\n" + timing_text(settings)
                + notes + f"\n\nMeasured by:\n{measured_by(rows)}\n")

    def plot(self, path: Path, rows: list[dict], title: str) -> None:
        rows_plot(path, rows, title, ours=lambda r: r["method"] == self.ours, kernel_label=self.kernel_label)

    def write(self, rows: list[dict], stem: Path, model: dict, settings: dict, meta: dict | None = None) -> None:
        """stem.json ({"meta", "rows"}: rows with method, its variant, kernel, output_tok_s, decode_latency_ms, the
        ratios, ...), stem.md (the table, failed rows with their error), stem.png (bars)."""
        meta = meta or provenance(command_line(self.name, []))
        text = self.markdown(rows, model, settings)  # adds the ratios to the rows
        write_json(with_ext(stem, ".json"), dict(meta=dict(model=model, **self.meta_extra, **settings), rows=rows),
                   meta)
        write_markdown(with_ext(stem, ".md"), text, meta)
        self.plot(with_ext(stem, ".png"), rows, f"{self.plot_title(model)} ({model['num_hidden_layers']} layers): "
                  f"{settings['prompts']} x {settings['input_len']} in / {settings['output_len']} out")
        print(text, flush=True)

    # ---- main

    def main(self, argv: list[str] | None = None) -> None:
        args = self.arguments(argv)
        if args.child:
            emit_row(self.tag, self.engine(args.child, str(self.child_model_dir(args)), args.prompts, args.input_len,
                                           args.output_len, args.gpu_memory_utilization, args.seed, args.tp))
            return
        model = self.model(args)
        settings = self.settings(args)
        stem, logs = self.result_paths(args)
        summary_to = self.summary_path(args, stem)
        command = command_line(self.name, argv)
        meta = provenance(command)
        # --merge: keep the other methods' rows of an earlier call
        rows = merged_rows(with_ext(stem, ".json"), args.method_list) if args.merge else []

        def write_rows(rows: list[dict]) -> None:
            self.write(rows, stem, model, settings, meta)
            if summary_to:
                self.write_summary(summary_to, rows)

        with self.model_dirs(args, model) as model_dir:
            run_rows(args.method_list, rows, logs,
                     lambda spec, log: self.measure(spec, self.child_command(spec, model_dir(spec), args), log,
                                                    args.timeout, command),
                     write_rows, self.order)
        print(f"wrote {stem}.json / .md / .png" + (f", {summary_to}" if summary_to else ""), flush=True)
