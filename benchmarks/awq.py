"""AWQ int4 serving end to end in vLLM, side by side: output tok/s and batch-1 decode latency per AWQ kernel.

A Llama-3-8B-shaped AWQ checkpoint with random codes (group 128, fp16; quant.awq_turbomind.checkpoint.random_checkpoint:
hidden 4096, intermediate 14336, 32 q / 8 KV heads, head_dim 128, vocab 128256, --layers of them), no tokenizer,
random prompt token ids (fixed seed), ignore_eos, greedy, no prefix caching, vLLM's default compilation and CUDA
graphs, gpu_memory_utilization 0.85. Rows (--methods, each <quantization>[:<linear backend>],
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
so a cut-off run keeps what it measured (the machinery, shared with `weights`, is in benchmarks.common).

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
import tempfile
import time
from pathlib import Path

from . import common

NAME = "awq"
METHODS = "awq_marlin,awq_marlin:marlin,awq_marlin:machete,awq:triton,awq_turbomind"
OURS = "awq_turbomind"
GROUP = 128
PROMPTS, INPUT_LEN, OUTPUT_LEN, LAYERS = (common.ROW_PROMPTS, common.ROW_INPUT_LEN, common.ROW_OUTPUT_LEN,
                                        common.ROW_LAYERS)
TAG = "AWQ_ROW"
# Llama-3-8B's shape in fp16: AWQ's kernels and TurboMind's are fp16
MODEL = dict(common.LLAMA3_8B, torch_dtype="float16")


# ---- configuration -----------------------------------------------------------------------------

def model_config(layers: int = LAYERS, input_len: int = INPUT_LEN, output_len: int = OUTPUT_LEN) -> dict:
    """Llama-3-8B's shape with `layers` decoder layers, positions enough for the requests."""
    return common.llama3_8b(MODEL, layers, input_len, output_len)


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


is_default, config_name = common.is_default_rows, common.rows_config_name


def result_paths(args: argparse.Namespace, gpu: str | None = None) -> tuple[Path, Path]:
    """(the results' path without extension, the children's log folder): the headline benchmarks/results/awq for
    the default configuration, benchmarks/results/awq/<gpu>-<what> otherwise; --out overrides both."""
    return common.rows_result_paths(NAME, args, gpu)


def default_checkpoint(layers: int) -> Path:
    return Path(tempfile.gettempdir()) / "turboquant-awq-bench" / f"llama3-8b-{layers}l-g{GROUP}"


def llm_kwargs(quantization: str, backend: str | None, model_dir: str, input_len: int, output_len: int,
               gpu_memory_utilization: float) -> dict:
    """LLM(...) of a row: the checkpoint in fp16, no tokenizer, no prefix caching, vLLM's default compilation and
    CUDA graphs, --linear-backend where the row names one."""
    kwargs = dict(model=model_dir, quantization=quantization, dtype="float16", skip_tokenizer_init=True, seed=0,
                  max_model_len=input_len + output_len + 8, gpu_memory_utilization=gpu_memory_utilization,
                  enable_prefix_caching=False)
    if backend:
        kwargs["linear_backend"] = backend
    return kwargs


def child_command(spec: str, model_dir: str | Path, args: argparse.Namespace) -> list[str]:
    """The process measuring one row: python -m benchmarks.awq ... --child <row> --checkpoint <dir>."""
    return common.module_command(NAME, *common.row_child_arguments(args), "--checkpoint", str(model_dir),
                                 "--child", spec)


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
    """Runs inside a fresh process: one engine, throughput and batch-1 decode latency (common.time_requests)."""
    quantization, backend = parse_method(spec)
    if quantization == OURS:  # the entry point registers it once installed; a source tree may lack the entry point
        from turboquant_vllm.quant.awq_turbomind import register

        register()
    from vllm import LLM

    llm = LLM(**llm_kwargs(quantization, backend, model_dir, input_len, output_len, gpu_memory_utilization))
    row = dict(method=quantization, linear_backend=backend or "auto", label=spec, **common.engine_facts(llm))
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    row.update(common.time_requests(llm, vocab, prompts, input_len, output_len, seed))
    return row


# ---- the parent: the children and their logs ---------------------------------------------------

KERNEL_PATTERNS = (
    (re.compile(r"Using (\w+) for AutoAWQMarlinLinearMethod"), "{0}"),
    (re.compile(r"on the GEMM kernels of turbomind (\S+)"), "turbomind {0}"),
    (re.compile(r"Falling back to unoptimized AWQ kernels"), "AutoAWQLinearMethod (Triton)"),
)


def log_facts(text: str) -> dict:
    """What a child's log says: the kernels its linear layers run ("kernel": those named, in order, joined by " + "),
    the weights' and KV cache's GiB, and the last error line."""
    return common.log_facts(text, KERNEL_PATTERNS)


def measure(spec: str, cmd: list[str], log: Path, timeout: float | None, command: str) -> dict:
    """A row: the child's measurements with what its log names, or the error that stopped it."""
    quantization, backend = parse_method(spec)
    return common.measure_row(cmd, log, timeout, command,
                               dict(method=quantization, linear_backend=backend or "auto", label=spec), TAG,
                               KERNEL_PATTERNS, common.child_env())


# ---- results -----------------------------------------------------------------------------------

ok = common.row_ok


def order(row: dict) -> int:
    """Rows in the order of the default --methods, others after them."""
    default = METHODS.split(",")
    return default.index(row.get("label")) if row.get("label") in default else len(default)


def add_ratios(rows: list[dict]) -> tuple[dict | None, dict | None]:
    """Each row against vLLM's best kernel: output_tok_s_vs_best_vllm (its tok/s / the best vLLM row's) and
    decode_speed_vs_best_vllm (the best vLLM latency / its own): > 1 is faster. Returns the two best vLLM rows."""
    vllm_rows = [r for r in rows if ok(r) and r["method"] != OURS]
    best_tput = max(vllm_rows, key=lambda r: r["output_tok_s"], default=None)
    timed = [r for r in vllm_rows if r.get("decode_latency_ms")]
    best_lat = min(timed, key=lambda r: r["decode_latency_ms"], default=None)
    common.add_row_ratios(rows, best_tput, best_lat, "best_vllm")
    return best_tput, best_lat


def markdown(rows: list[dict], model: dict, settings: dict) -> str:
    best_tput, best_lat = add_ratios(rows)
    fmt, ratio = common.fmt, common.ratio_cell
    columns = [
        ("method", lambda r: r["method"]),
        ("--linear-backend", lambda r: r.get("linear_backend") or "auto"),
        ("kernel", common.kernel_cell),
        ("output tok/s", lambda r: fmt(r.get("output_tok_s"), ",.0f")),
        ("vs best vLLM", lambda r: ratio(r, "output_tok_s_vs_best_vllm")),
        ("batch-1 decode ms/token", lambda r: fmt(r.get("decode_latency_ms"), ".2f")),
        ("decode speed vs best vLLM", lambda r: ratio(r, "decode_speed_vs_best_vllm")),
        ("CUDA graphs", lambda r: (r.get("cudagraph_mode") or "").lower()),
        ("KV cache tokens", lambda r: fmt(r.get("kv_cache_tokens"), ",")),
        ("weights GiB", lambda r: fmt(r.get("weights_gib"), ".2f")),
    ]
    best = []
    if best_tput:
        best.append(f"best vLLM throughput: {best_tput['label']} ({best_tput.get('kernel')})")
    if best_lat:
        best.append(f"best vLLM batch-1 decode: {best_lat['label']} ({best_lat.get('kernel')})")
    return (f"AWQ int4 (group {GROUP}, random codes, fp16) in vLLM end to end, Llama-3-8B shape: "
            f"{common.shape_text(model)}.\n\n"
            + common.markdown_table(rows, columns)
            + "\n\n" + common.timing_text(settings) + " Ratios: against the best vLLM kernel, > 1 faster"
            + (f" ({'; '.join(best)})" if best else "") + ". Kernel: the one the engine's log names."
            + f"\n\nMeasured by:\n{common.measured_by(rows)}\n")


def plot(path: Path, rows: list[dict], title: str) -> None:
    common.rows_plot(path, rows, title, ours=lambda r: r["method"] == OURS,
                     kernel_label=lambda k: k.replace("LinearKernel", ""))


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
    common.add_row_arguments(ap, NAME)
    ap.add_argument("--checkpoint", type=Path, help="the random AWQ checkpoint's folder (written if absent or of "
                    "another shape; default <tmp>/turboquant-awq-bench/llama3-8b-<layers>l-g128)")
    args = ap.parse_args(argv)
    try:
        args.method_list = methods(args.methods)
    except ValueError as e:
        ap.error(str(e))
    common.check_row_arguments(ap, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    if args.child:
        common.emit_row(TAG, engine(args.child, str(args.checkpoint), args.prompts, args.input_len, args.output_len,
                                     args.gpu_memory_utilization, args.seed))
        return
    model = model_config(args.layers, args.input_len, args.output_len)
    settings = common.row_settings(args)
    stem, logs = result_paths(args)
    command = common.command_line(NAME, argv)
    provenance = common.provenance(command)
    # --merge: keep the other methods' rows of an earlier call
    rows = common.merged_rows(common.with_ext(stem, ".json"), args.method_list) if args.merge else []
    model_dir = ensure_checkpoint(model, args.checkpoint or default_checkpoint(args.layers))
    common.run_rows(
        args.method_list, rows, logs,
        lambda spec, log: measure(spec, child_command(spec, model_dir, args), log, args.timeout, command),
        lambda rows: write(rows, stem, model, settings, provenance), order)
    print(f"wrote {stem}.json / .md / .png", flush=True)


if __name__ == "__main__":
    main()
