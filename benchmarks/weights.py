"""Weight quantization in vLLM end to end, side by side with bf16 weights: output tok/s and batch-1 decode latency.

Decode is memory-bound: at batch 1 every step reads all the weights, so 4-bit weights (quartet2's NVFP4 through
vLLM's Marlin FP4 kernel, W4A16, 0.28x the bytes of bf16) must beat bf16 there. A Llama-3-8B-shaped model (hidden
4096, intermediate 14336, 32 q / 8 KV heads, head_dim 128, vocab 128256, --layers of them) with vLLM's random dummy
weights (load_format "dummy": only a config.json, written into a temporary folder; bf16, uniform in +-1e-3; the
quantized rows quantize them after loading, as they would a real checkpoint's), no tokenizer, random prompt token
ids (fixed seed), ignore_eos, greedy, no prefix caching, vLLM's default compilation and CUDA graphs,
gpu_memory_utilization 0.85. Rows (--methods):

- bf16: no quantization (UnquantizedLinearMethod: the bf16 matmul);
- fp8: vLLM's own online FP8 (`quantization="fp8"` on the bf16 weights: per-tensor FP8 weights, dynamic FP8
  activations; the kernel its log names, e.g. CutlassFP8ScaledMMLinearKernel on Hopper): the anchor;
- quartet2: ours (`-q quartet2`), NVFP4 weights quantized in process_weights_after_loading, path auto (on Hopper
  vLLM's Marlin FP4, W4A16); quartet2:<path> runs it under TURBOQUANT_QUARTET2_PATH=<path> (marlin, emulate:
  the exact W4A4 emulation, a numerics path, slower than bf16; opt-in, not in the default rows).

The lm_head and embeddings stay bf16 in every row (vLLM quantizes linear layers only). Measurements as `awq`'s
(benchmarks.common): output tok/s = output tokens / wall time of one llm.generate over --prompts requests of
--input-len tokens generating --output-len each (after a warm-up generate); batch-1 decode ms/token = (one request
generating --output-len tokens - the same generating 1) / (--output-len - 1), median of 3; KV cache tokens from the
engine; weights GiB and the kernel from the engine's log ("Model loading took ... GiB", "quartet2: NVFP4 path ...",
"Selected ... for Fp8PerTensorOnlineLinearMethod"). Ratios: against the bf16 row, > 1 faster. Each row runs in its
own process with a fresh VLLM_CACHE_ROOT (vLLM's on-disk AOT compile cache once replayed a stale artifact of older
quartet2 code: NOTES.md), so every row compiles afresh; a row that fails (or runs past --timeout) is written with its
error, and the results are written after every row, so a cut-off run keeps what it measured.

    python -m benchmarks weights [--methods bf16,fp8,quartet2] [--prompts 1000] [--input-len 1024]
        [--output-len 128] [--layers 32] [--gpu-memory-utilization 0.85] [--timeout S] [--out PATH] [--merge]

The default configuration (32 layers, 1000 x 1024 in / 128 out) writes the headline
benchmarks/results/weights.{json,md,png}; any other writes
benchmarks/results/weights/<gpu>-llama3-8b-<layers>l-<prompts>x<in>-<out>.{json,md,png}. The children's logs go to
benchmarks/results/weights/<gpu>-<that name>/ (the --out path's folder of its name with --out), <row>.log each.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from . import common

NAME = "weights"
METHODS = "bf16,fp8,quartet2"
ORDER = ("bf16", "fp8", "quartet2", "quartet2:marlin", "quartet2:emulate")  # rows in this order, others after
BF16 = "bf16"
OURS = "quartet2"
PATH_ENV = "TURBOQUANT_QUARTET2_PATH"  # quant.quartet2.method.PATH_ENV (not imported: the parent stays torch-free)
PATHS = ("auto", "marlin", "emulate")
TAG = "WEIGHTS_ROW"
MODEL = dict(common.LLAMA3_8B, torch_dtype="bfloat16")
BF16_KERNEL = "UnquantizedLinearMethod (bf16 matmul)"


# ---- configuration -----------------------------------------------------------------------------

def model_config(layers: int = common.ROW_LAYERS, input_len: int = common.ROW_INPUT_LEN,
                 output_len: int = common.ROW_OUTPUT_LEN) -> dict:
    """Llama-3-8B's shape in bf16 with `layers` decoder layers, positions enough for the requests."""
    return common.llama3_8b(MODEL, layers, input_len, output_len)


def parse_method(spec: str) -> tuple[str, str | None]:
    """"bf16" -> ("bf16", None); "fp8" -> ("fp8", None): vLLM's quantization="fp8" (any other name: that vLLM
    method, online); "quartet2" / "quartet2:auto" -> ("quartet2", None); "quartet2:emulate" -> ("quartet2",
    "emulate")."""
    method, _, path = spec.strip().partition(":")
    method = method.strip().lower()
    if not re.fullmatch(r"[a-z0-9_]+", method):
        raise ValueError(f"bad method in {spec!r}")
    path = path.strip().lower() or None
    if method != OURS and path:
        raise ValueError(f"only {OURS} takes a path (:{'/:'.join(PATHS)}), not {spec!r}")
    if path and path not in PATHS:
        raise ValueError(f"{OURS} path {path!r} in {spec!r}: choose one of {', '.join(PATHS)}")
    return method, (None if path == "auto" else path)


def label(method: str, path: str | None) -> str:
    return f"{method}:{path}" if path else method


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


def result_paths(args: argparse.Namespace, gpu: str | None = None) -> tuple[Path, Path]:
    """(the results' path without extension, the children's log folder): the headline benchmarks/results/weights
    for the default configuration, benchmarks/results/weights/<gpu>-<what> otherwise; --out overrides both."""
    return common.rows_result_paths(NAME, args, gpu)


def llm_kwargs(method: str, model_dir: str, input_len: int, output_len: int, gpu_memory_utilization: float) -> dict:
    """LLM(...) of a row: the config's shape with dummy bf16 weights, quantized as the row says (bf16: not at all),
    no tokenizer, no prefix caching, vLLM's default compilation and CUDA graphs."""
    kwargs = dict(model=model_dir, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, seed=0,
                  max_model_len=input_len + output_len + 8, gpu_memory_utilization=gpu_memory_utilization,
                  enable_prefix_caching=False)
    if method != BF16:
        kwargs["quantization"] = method
    return kwargs


def row_env(method: str, path: str | None) -> dict:
    """What a row's process adds to the environment: quartet2's path (auto unless the row names one, so a path set
    in the caller's environment never leaks into the plain row)."""
    return {PATH_ENV: path or "auto"} if method == OURS else {}


def child_command(spec: str, model_dir: str | Path, args: argparse.Namespace) -> list[str]:
    """The process measuring one row: python -m benchmarks.weights ... --model-dir <dir> --child <row>."""
    return common.module_command(NAME, *common.row_child_arguments(args), "--model-dir", str(model_dir),
                                 "--child", spec)


def write_model(model: dict, folder: Path) -> Path:
    """The model's folder for load_format "dummy": its config.json alone."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model, indent=1))
    return folder


# ---- the child: one engine, one row ------------------------------------------------------------

def engine(spec: str, model_dir: str, prompts: int, input_len: int, output_len: int, gpu_memory_utilization: float,
           seed: int = 0) -> dict:
    """Runs inside a fresh process: one engine, throughput and batch-1 decode latency (common.time_requests)."""
    method, path = parse_method(spec)
    if method == OURS:  # the entry point registers it once installed; a source tree may lack the entry point
        os.environ.update(row_env(method, path))  # the parent sets it too; this keeps a child run by hand right
        from turboquant_vllm.quant.quartet2.method import register

        register()
    from vllm import LLM

    llm = LLM(**llm_kwargs(method, model_dir, input_len, output_len, gpu_memory_utilization))
    row = dict(method=method, path=path or ("auto" if method == OURS else None), label=spec,
               **common.engine_facts(llm))
    if method == BF16:
        row["kernel"] = BF16_KERNEL  # no log line names it
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    row.update(common.time_requests(llm, vocab, prompts, input_len, output_len, seed))
    return row


# ---- the parent: the children and their logs ---------------------------------------------------

KERNEL_PATTERNS = (
    (re.compile(r"quartet2: NVFP4 path marlin\b"), "Marlin FP4 W4A16 (quartet2 marlin)"),
    (re.compile(r"quartet2: NVFP4 path emulate\b"), "W4A4 emulation (quartet2 emulate)"),
    (re.compile(r"Selected (\w+) for Fp8\w*LinearMethod"), "{0}"),
)


def log_facts(text: str) -> dict:
    """What a child's log says: the kernel its linear layers run, the weights' and KV cache's GiB, the last error."""
    return common.log_facts(text, KERNEL_PATTERNS)


def measure(spec: str, cmd: list[str], log: Path, timeout: float | None, command: str) -> dict:
    """A row in its process (quartet2's path and a fresh VLLM_CACHE_ROOT in its environment): the child's
    measurements with what its log names, or the error that stopped it."""
    method, path = parse_method(spec)
    cache = Path(tempfile.mkdtemp(prefix="turboquant-weights-vllm-cache-"))
    try:
        env = common.child_env(dict(os.environ, VLLM_CACHE_ROOT=str(cache), **row_env(method, path)))
        return common.measure_row(cmd, log, timeout, command,
                                   dict(method=method, path=path or ("auto" if method == OURS else None), label=spec),
                                   TAG, KERNEL_PATTERNS, env)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


# ---- results -----------------------------------------------------------------------------------

ok = common.row_ok


def order(row: dict) -> int:
    return ORDER.index(row.get("label")) if row.get("label") in ORDER else len(ORDER)


def add_ratios(rows: list[dict]) -> dict | None:
    """Each row against the bf16 row: output_tok_s_vs_bf16 (its tok/s / bf16's) and decode_speed_vs_bf16 (bf16's
    batch-1 decode latency / its own): > 1 is faster. Returns the bf16 row (None where it failed or is absent)."""
    ref = next((r for r in rows if r.get("label") == BF16 and ok(r)), None)
    common.add_row_ratios(rows, ref, ref if ref and ref.get("decode_latency_ms") else None, "bf16")
    return ref


def markdown(rows: list[dict], model: dict, settings: dict) -> str:
    ref = add_ratios(rows)
    fmt, ratio = common.fmt, common.ratio_cell
    columns = [
        ("method", lambda r: r["method"]),
        ("quartet2 path", lambda r: r.get("path") or ""),
        ("kernel", common.kernel_cell),
        ("output tok/s", lambda r: fmt(r.get("output_tok_s"), ",.0f")),
        ("vs bf16", lambda r: ratio(r, "output_tok_s_vs_bf16")),
        ("batch-1 decode ms/token", lambda r: fmt(r.get("decode_latency_ms"), ".2f")),
        ("decode speed vs bf16", lambda r: ratio(r, "decode_speed_vs_bf16")),
        ("CUDA graphs", lambda r: (r.get("cudagraph_mode") or "").lower()),
        ("KV cache tokens", lambda r: fmt(r.get("kv_cache_tokens"), ",")),
        ("weights GiB", lambda r: fmt(r.get("weights_gib"), ".2f")),
    ]
    return (f"Weight quantization in vLLM end to end vs bf16 weights, Llama-3-8B shape: "
            f"{common.shape_text(model)}; vLLM's dummy weights (random bf16), quantized after loading.\n\n"
            + common.markdown_table(rows, columns)
            + "\n\n" + common.timing_text(settings) + " Ratios: against the bf16 row, > 1 faster"
            + ("" if ref else " (no bf16 row measured: no ratios)") + ". Kernel: the one the engine's log names "
            "(bf16: no log line; quartet2 marlin: NVFP4 weights through vLLM's Marlin FP4 kernel, bf16 activations). "
            "Weights GiB: the engine's \"Model loading took\" (lm_head and embeddings bf16 in every row)."
            + f"\n\nMeasured by:\n{common.measured_by(rows)}\n")


def plot(path: Path, rows: list[dict], title: str) -> None:
    common.rows_plot(path, rows, title, ours=lambda r: r["method"] == OURS,
                     kernel_label=lambda k: (k.replace("LinearKernel", "").replace("LinearMethod ", "\n")
                                             .replace("ScaledMM", "\nScaledMM").replace(" (quartet2 ", "\n(")))


def write(rows: list[dict], stem: Path, model: dict, settings: dict, provenance: dict | None = None) -> None:
    """stem.json ({"meta", "rows"}: rows with method, path, kernel, output_tok_s, decode_latency_ms, the ratios vs
    bf16, ...), stem.md (the table, failed rows with their error), stem.png (bars)."""
    provenance = provenance or common.provenance(common.command_line(NAME, []))
    text = markdown(rows, model, settings)  # adds the ratios to the rows
    common.write_json(common.with_ext(stem, ".json"), dict(meta=dict(model=model, load_format="dummy", **settings),
                                                           rows=rows), provenance)
    common.write_markdown(common.with_ext(stem, ".md"), text, provenance)
    plot(common.with_ext(stem, ".png"), rows, f"Weight quantization in vLLM vs bf16, Llama-3-8B shape "
         f"({model['num_hidden_layers']} layers): {settings['prompts']} x {settings['input_len']} in / "
         f"{settings['output_len']} out")
    print(text, flush=True)


# ---- the command line --------------------------------------------------------------------------

def arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--methods", default=METHODS, help="bf16, fp8 (or another vLLM method), quartet2[:auto|marlin|"
                    "emulate], comma-separated (default: %(default)s)")
    common.add_row_arguments(ap, NAME)
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)  # the child's: the parent's config.json
    args = ap.parse_args(argv)
    try:
        args.method_list = methods(args.methods)
    except ValueError as e:
        ap.error(str(e))
    common.check_row_arguments(ap, args)
    if args.child and not args.model_dir:
        ap.error("--child needs --model-dir")
    return args


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    if args.child:
        common.emit_row(TAG, engine(args.child, str(args.model_dir), args.prompts, args.input_len, args.output_len,
                                     args.gpu_memory_utilization, args.seed))
        return
    model = model_config(args.layers, args.input_len, args.output_len)
    settings = common.row_settings(args)
    stem, logs = result_paths(args)
    command = common.command_line(NAME, argv)
    provenance = common.provenance(command)
    # --merge: keep the other methods' rows of an earlier call
    rows = common.merged_rows(common.with_ext(stem, ".json"), args.method_list) if args.merge else []
    with tempfile.TemporaryDirectory(prefix="turboquant-weights-model-") as folder:
        model_dir = write_model(model, Path(folder))
        common.run_rows(
            args.method_list, rows, logs,
            lambda spec, log: measure(spec, child_command(spec, model_dir, args), log, args.timeout, command),
            lambda rows: write(rows, stem, model, settings, provenance), order)
    print(f"wrote {stem}.json / .md / .png", flush=True)


if __name__ == "__main__":
    main()
