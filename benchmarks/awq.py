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
so a cut-off run keeps what it measured (the machinery, shared with `weights`, is in benchmarks.engine_rows).

    python -m benchmarks awq [--methods awq_marlin,awq_marlin:marlin,awq_marlin:machete,awq:triton,awq_turbomind]
        [--prompts 1000] [--input-len 1024] [--output-len 128] [--layers 32] [--gpu-memory-utilization 0.85]
        [--tp N] [--checkpoint DIR] [--timeout S] [--out PATH] [--merge]

The default configuration (32 layers, 1000 x 1024 in / 128 out) writes the headline
benchmarks/results/awq.{json,md,png}; any other writes
benchmarks/results/awq/<gpu>-llama3-8b-<layers>l-<prompts>x<in>-<out>[-tp<N>].{json,md,png}. The children's logs go to
benchmarks/results/awq/<gpu>-<that name>/ (the --out path's folder of its name with --out), <row>.log each.
The checkpoint is written once into --checkpoint (default: <tmp>/turboquant-awq-bench/llama3-8b-<layers>l-g128) and
reused by later calls while its config.json is the same.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

from . import engine_rows

METHODS = "awq_marlin,awq_marlin:marlin,awq_marlin:machete,awq:triton,awq_turbomind"
OURS = "awq_turbomind"
GROUP = 128
# Llama-3-8B's shape in fp16: AWQ's kernels and TurboMind's are fp16
MODEL = dict(engine_rows.LLAMA3_8B, torch_dtype="float16")


# ---- configuration -----------------------------------------------------------------------------

def model_config(layers: int = engine_rows.ROW_LAYERS, input_len: int = engine_rows.ROW_INPUT_LEN,
                 output_len: int = engine_rows.ROW_OUTPUT_LEN) -> dict:
    """Llama-3-8B's shape with `layers` decoder layers, positions enough for the requests."""
    return engine_rows.llama3_8b(MODEL, layers, input_len, output_len)


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


def default_checkpoint(layers: int) -> Path:
    return Path(tempfile.gettempdir()) / "turboquant-awq-bench" / f"llama3-8b-{layers}l-g{GROUP}"


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


# ---- the rows: what engine_rows.WeightRows runs ------------------------------------------------

class Awq(engine_rows.WeightRows):
    name, tag = "awq", "AWQ_ROW"
    kernel_patterns = (
        (re.compile(r"Using (\w+) for AutoAWQMarlinLinearMethod"), "{0}"),
        (re.compile(r"on the GEMM kernels of turbomind (\S+)"), "turbomind {0}"),
        (re.compile(r"Falling back to unoptimized AWQ kernels"), "AutoAWQLinearMethod (Triton)"),
    )
    order_labels = tuple(METHODS.split(","))  # the default --methods' order
    ours = OURS
    dtype = "float16"
    meta_extra = dict(group_size=GROUP)
    variant_column = ("--linear-backend", lambda r: r.get("linear_backend") or "auto")
    versus = ("best vLLM", "best_vllm")
    parse_method = staticmethod(parse_method)

    def identity(self, spec: str) -> dict:
        quantization, backend = parse_method(spec)
        return dict(method=quantization, linear_backend=backend or "auto", label=spec)

    def add_arguments(self, ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--methods", default=METHODS,
                        help="<quantization>[:<linear backend>],... (default: %(default)s)")
        engine_rows.add_row_arguments(ap, self.name)
        ap.add_argument("--checkpoint", type=Path, help="the random AWQ checkpoint's folder (written if absent or of "
                        "another shape; default <tmp>/turboquant-awq-bench/llama3-8b-<layers>l-g128)")

    def model(self, args: argparse.Namespace) -> dict:
        return model_config(args.layers, args.input_len, args.output_len)

    @contextlib.contextmanager
    def model_dirs(self, args: argparse.Namespace, model: dict) -> Iterator[Callable[[str], Path]]:
        """Every row reads one checkpoint, written once."""
        path = ensure_checkpoint(model, args.checkpoint or default_checkpoint(args.layers))
        yield lambda spec: path

    def child_arguments(self, args: argparse.Namespace, model_dir: str | Path) -> list[str]:
        return ["--checkpoint", str(model_dir)]

    def child_model_dir(self, args: argparse.Namespace) -> Path:
        return args.checkpoint

    def prepare_child(self, method: str, variant: str | None, config: dict) -> None:
        if method == OURS:  # the entry point registers it once installed; a source tree may lack the entry point
            from turboquant_vllm.quant.awq_turbomind import register

            register()

    def llm_kwargs(self, method: str, variant: str | None, model_dir: str, input_len: int, output_len: int,
                   gpu_memory_utilization: float) -> dict:
        """The checkpoint in fp16, --linear-backend where the row names one."""
        kwargs = dict(super().llm_kwargs(method, variant, model_dir, input_len, output_len, gpu_memory_utilization),
                      quantization=method)
        if variant:
            kwargs["linear_backend"] = variant
        return kwargs

    def add_ratios(self, rows: list[dict]) -> str:
        """Each row against vLLM's best kernel: output_tok_s_vs_best_vllm (its tok/s / the best vLLM row's) and
        decode_speed_vs_best_vllm (the best vLLM latency / its own): > 1 is faster."""
        vllm_rows = [r for r in rows if engine_rows.row_ok(r) and r["method"] != OURS]
        best_tput = max(vllm_rows, key=lambda r: r["output_tok_s"], default=None)
        timed = [r for r in vllm_rows if r.get("decode_latency_ms")]
        best_lat = min(timed, key=lambda r: r["decode_latency_ms"], default=None)
        engine_rows.add_row_ratios(rows, best_tput, best_lat, "best_vllm")
        best = []
        if best_tput:
            best.append(f"best vLLM throughput: {best_tput['label']} ({best_tput.get('kernel')})")
        if best_lat:
            best.append(f"best vLLM batch-1 decode: {best_lat['label']} ({best_lat.get('kernel')})")
        return (" Ratios: against the best vLLM kernel, > 1 faster" + (f" ({'; '.join(best)})" if best else "")
                + ". Kernel: the one the engine's log names.")

    def intro(self, rows: list[dict], model: dict) -> str:
        return (f"AWQ int4 (group {GROUP}, random codes, fp16) in vLLM end to end, Llama-3-8B shape: "
                f"{engine_rows.shape_text(model)}.")

    def plot_title(self, model: dict) -> str:
        return "AWQ int4 in vLLM, Llama-3-8B shape"

    def kernel_label(self, kernel: str) -> str:
        return kernel.replace("LinearKernel", "")


BENCH = Awq()
main = BENCH.main


if __name__ == "__main__":
    main()
