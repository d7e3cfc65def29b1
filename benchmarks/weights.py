"""Weight quantization in vLLM end to end, side by side with bf16 weights: output tok/s and batch-1 decode latency.

Decode is memory-bound: at batch 1 every step reads all the weights, so 4-bit weights (quartet2's NVFP4 through
vLLM's Marlin FP4 kernel, W4A16, 0.28x the bytes of bf16) must beat bf16 there. The model (--model):

- llama3-8b (default): a Llama-3-8B-shaped model (hidden 4096, intermediate 14336, 32 q / 8 KV heads, head_dim 128,
  vocab 128256, --layers of them, 32 by default);
- cloverlm-4b: CloverLM-4B's shape (IST-DASLab/CloverLM: 29 blocks, 28 q / 7 KV heads, head_dim 128, hidden 3584,
  ReLU^2 MLP 14336, vocab 32000, tied embeddings; --layers of its blocks, all 29 by default), architecture
  CloverLMForCausalLM (turboquant_vllm.models.cloverlm, registered by this package's vLLM entry point: a child that
  finds vLLM without it stops with that error). Its position limit (max_context 1024, what it was trained at) is
  raised to what the requests need (1,024 + 128 + 8): random weights, speed only.

Both with vLLM's random dummy weights (load_format "dummy": only a config.json, written into a temporary folder;
bf16, uniform in +-1e-3; the quantized rows quantize them after loading, as they would a real checkpoint's), no
tokenizer, random prompt token ids (fixed seed), ignore_eos, greedy, no prefix caching, vLLM's default compilation and
CUDA graphs, gpu_memory_utilization 0.85. Rows (--methods):

- bf16: no quantization (UnquantizedLinearMethod: the bf16 matmul);
- fp8: vLLM's own online FP8 (`quantization="fp8"` on the bf16 weights: per-tensor FP8 weights, dynamic FP8
  activations; the kernel its log names, e.g. CutlassFP8ScaledMMLinearKernel on Hopper): the anchor;
- quartet2: ours (`-q quartet2`), NVFP4 weights quantized in process_weights_after_loading, path auto (on Hopper
  vLLM's Marlin FP4, W4A16); quartet2:<path> runs it under TURBOQUANT_QUARTET2_PATH=<path> (w4a4: Blackwell's FP4
  GEMM; marlin; emulate: the exact W4A4 emulation, a numerics path, slower than bf16; opt-in for llama3-8b);
- modelopt_fp4: vLLM's own loading of NVFP4 weights (`quantization="modelopt_fp4"`, ModelOptNvFp4LinearMethod; on
  Hopper its kernel is MarlinNvFp4LinearKernel, W4A16, as quartet2's marlin path): the row's folder also holds an
  hf_quant_config.json as NVIDIA ModelOpt writes it (producer "modelopt", quant_algo NVFP4, group 16,
  exclude_modules CloverLM's ["emb", "linear"] as CloverLM's converter writes them, Llama's ["lm_head"]), and the
  dummy loader fills the NVFP4 parameters themselves (uint8 codes left as allocated, fp8 block scales and fp32 global
  scales uniform in +-1e-3): NVFP4 weights of the same shapes, not the bf16 rows' values quantized. vLLM 0.25 takes
  that config for a custom architecture (ModelConfig's override checks and get_quant_config read the folder's file;
  the exclusions match CloverLM's module names). CloverLM's own NVFP4 release names producer "cloverlm_converter",
  which vLLM's modelopt does not read (no "modelopt" producer or quant_method) and quartet2 claims
  (override_quantization_method), hence ModelOpt's producer here.

Defaults per --model: llama3-8b --methods bf16,fp8,quartet2, 1000 requests of 1,024 in / 128 out; cloverlm-4b
--methods bf16,quartet2:marlin,quartet2:emulate,modelopt_fp4, 64 requests of 1,024 in / 128 out (issue 25's
configuration). cloverlm-4b also writes benchmarks/results/quartet2.json (<out>-quartet2.json with --out):
{"rows": [{"path", "decode_latency_ms", "output_tok_s", "weight_gib"}]}, one per measured row (failed rows are left
out there; the full results keep them with their error): path "bf16", "marlin", "emulate", "quartet2" (path auto),
"modelopt_fp4", ...; decode_latency_ms the batch-1 decode ms/token, weight_gib the engine log's "Model loading took";
its provenance is the full results' meta.

The embeddings and the LM head stay bf16 in every row (vLLM quantizes linear layers only). Measurements as `awq`'s
(benchmarks.engine_rows): output tok/s = output tokens / wall time of one llm.generate over --prompts requests of
--input-len tokens generating --output-len each (after a warm-up generate); batch-1 decode ms/token = (one request
generating --output-len tokens - the same generating 1) / (--output-len - 1), median of 3; KV cache tokens from the
engine; weights GiB and the kernel from the engine's log ("Model loading took ... GiB", "quartet2: NVFP4 path ...",
"Selected ... for Fp8PerTensorOnlineLinearMethod"). Ratios: against the bf16 row, > 1 faster. Each row runs in its
own process with a fresh VLLM_CACHE_ROOT (vLLM's on-disk AOT compile cache once replayed a stale artifact of older
quartet2 code: NOTES.md), so every row compiles afresh; a row that fails (or runs past --timeout) is written with its
error, and the results are written after every row, so a cut-off run keeps what it measured.

    python -m benchmarks weights [--model llama3-8b|cloverlm-4b] [--methods bf16,fp8,quartet2] [--prompts 1000]
        [--input-len 1024] [--output-len 128] [--layers 32] [--gpu-memory-utilization 0.85] [--timeout S]
        [--tp N] [--out PATH] [--merge]

The default configuration (llama3-8b, 32 layers, 1000 x 1024 in / 128 out) writes the headline
benchmarks/results/weights.{json,md,png}; any other writes
benchmarks/results/weights/<gpu>-<model>-<layers>l-<prompts>x<in>-<out>.{json,md,png} (e.g.
h100-cloverlm-4b-29l-64x1024-128). The children's logs go to benchmarks/results/weights/<gpu>-<that name>/ (the --out
path's folder of its name with --out), <row>.log each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from . import common, engine_rows

METHODS = "bf16,fp8,quartet2"
# rows in this order, others after
ORDER = ("bf16", "fp8", "quartet2", "quartet2:w4a4", "quartet2:marlin", "quartet2:emulate", "modelopt_fp4")
BF16 = "bf16"
OURS = "quartet2"
MODELOPT = "modelopt_fp4"  # vLLM's NVFP4 checkpoint method: its rows load NVFP4 parameters (modelopt_quant_config)
PATH_ENV = "TURBOQUANT_QUARTET2_PATH"  # quant.quartet2.plugin.paths.PATH_ENV (not imported: the parent stays torch-free)
PATHS = ("auto", "w4a4", "marlin", "emulate")
MODEL = dict(engine_rows.LLAMA3_8B, torch_dtype="bfloat16")
BF16_KERNEL = "UnquantizedLinearMethod (bf16 matmul)"

LLAMA, CLOVERLM = engine_rows.ROWS_MODEL, "cloverlm-4b"
# CloverLM-4B's dimensions (turboquant_vllm.models.cloverlm.reference.CloverLMShape's fields), from the upstream
# repository IST-DASLab/CloverLM: README.md's training command of the released run ("4b-28h-29d-cm310b-v3 ...
# --num_blocks=29 --heads=28 --ratio=4"); src/train.py's defaults for what it leaves out (--zeta 16, and d_head =
# zeta * 8 = 128 as src/models/utils_models.py and src/evals/hf_model/convert_checkpoint.py derive it;
# --vocab_size 32000, the TokenMonster englishcode-32000 vocabulary; --context 1024); tied embeddings (REPORT.md:
# "29 blocks ... ReLU^2 activation, and aspect ratio 4 ... context length 1024 ... with tied embeddings";
# convert_checkpoint.py writes weight_tying=True). So hidden 28 x 128 = 3584, 28 / 4 = 7 KV heads, MLP 4 x 3584 =
# 14336: ~4.0B parameters (29 x 134.9M in the blocks + 114.7M in the tied embedding).
CLOVERLM_4B = dict(vocab_size=32000, num_blocks=29, heads=28, d_head=128, ratio=4, max_context=1024,
                   weight_tying=True)
# per --model: its title, default rows and requests, and its depth (all of its layers unless --layers)
MODELS = {
    LLAMA: dict(title="Llama-3-8B", methods=METHODS, prompts=engine_rows.ROW_PROMPTS,
                input_len=engine_rows.ROW_INPUT_LEN, output_len=engine_rows.ROW_OUTPUT_LEN,
                layers=engine_rows.ROW_LAYERS),
    CLOVERLM: dict(title="CloverLM-4B", methods=f"{BF16},{OURS}:marlin,{OURS}:emulate,{MODELOPT}", prompts=64,
                   input_len=1024, output_len=128, layers=CLOVERLM_4B["num_blocks"]),
}
TITLES = {"LlamaForCausalLM": MODELS[LLAMA]["title"], "CloverLMForCausalLM": MODELS[CLOVERLM]["title"]}
SUMMARY = common.RESULTS / "quartet2.json"  # cloverlm-4b's summary (issue 25): summary()


# ---- configuration -----------------------------------------------------------------------------

def model_config(layers: int = engine_rows.ROW_LAYERS, input_len: int = engine_rows.ROW_INPUT_LEN,
                 output_len: int = engine_rows.ROW_OUTPUT_LEN, model: str = LLAMA) -> dict:
    """The config.json of `model` in bf16 with `layers` decoder layers, positions enough for the requests: Llama-3-8B's
    shape, or CloverLM-4B's (CloverLM's own fields and the HF ones, checkpoint.config_of)."""
    if model == LLAMA:
        return engine_rows.llama3_8b(MODEL, layers, input_len, output_len)
    if model != CLOVERLM:
        raise ValueError(f"unknown model {model!r}: choose one of {', '.join(MODELS)}")
    from turboquant_vllm.models.cloverlm.checkpoint import config_of
    from turboquant_vllm.models.cloverlm.reference import CloverLMShape

    return config_of(CloverLMShape(**dict(CLOVERLM_4B, num_blocks=layers, max_context=max(
        CLOVERLM_4B["max_context"], input_len + output_len + 8))))


def model_title(model: dict) -> str:
    """"Llama-3-8B" / "CloverLM-4B" for a config of model_config (its architecture otherwise)."""
    arch = model["architectures"][0]
    return TITLES.get(arch, arch)


def modelopt_quant_config(model: dict) -> dict:
    """hf_quant_config.json for the modelopt_fp4 row, as NVIDIA ModelOpt writes it for NVFP4 (vLLM's modelopt reads
    it only with producer "modelopt"): CloverLM's exclusions as its converter writes them (the embedding and the
    untied head), Llama's its lm_head."""
    exclude = ["emb", "linear"] if model["architectures"][0] == "CloverLMForCausalLM" else ["lm_head"]
    return {"producer": {"name": "modelopt"},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                             "exclude_modules": exclude}}


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


def row_env(method: str, path: str | None) -> dict:
    """What a row's process adds to the environment: quartet2's path (auto unless the row names one, so a path set
    in the caller's environment never leaks into the plain row)."""
    return {PATH_ENV: path or "auto"} if method == OURS else {}


def write_model(model: dict, folder: Path, quant_config: dict | None = None) -> Path:
    """The model's folder for load_format "dummy": its config.json alone, or with an hf_quant_config.json (the
    modelopt_fp4 row's)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model, indent=1))
    if quant_config is not None:
        (folder / "hf_quant_config.json").write_text(json.dumps(quant_config, indent=1))
    return folder


def row_model_dir(spec: str, model: dict, root: Path) -> Path:
    """A row's model folder under root, written once: modelopt_fp4 rows read NVFP4 parameters (root/nvfp4, with the
    hf_quant_config.json), the others the bf16 config alone (root/bf16: no quantization config that a method could
    claim)."""
    if parse_method(spec)[0] == MODELOPT:
        folder = root / "nvfp4"
        return folder if folder.exists() else write_model(model, folder, modelopt_quant_config(model))
    folder = root / "bf16"
    return folder if folder.exists() else write_model(model, folder)


def check_architecture(arch: str) -> None:
    """Stops the child with a clear error where vLLM does not know the config's architecture, after loading vLLM's
    plugins as LLM(...) would (this package's entry point registers CloverLMForCausalLM)."""
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    if arch not in ModelRegistry.get_supported_archs():
        raise RuntimeError(f"vLLM does not know the architecture {arch}: no vLLM model or plugin registers it here "
                           f"(CloverLMForCausalLM comes from turboquant-vllm's vllm.general_plugins entry point: "
                           f"install this package, e.g. pip install -e ., at a version that registers it)")


# ---- cloverlm-4b's summary ---------------------------------------------------------------------

def summary_row_path(row: dict) -> str:
    """A row's "path" in the summary: quartet2's path (marlin, emulate; "quartet2" for auto), else its label."""
    return row["path"] if row.get("method") == OURS and row.get("path") not in (None, "auto") else row["label"]


def summary(rows: list[dict]) -> dict:
    """cloverlm-4b's summary, issue 25's schema: {"rows": [{"path", "decode_latency_ms", "output_tok_s",
    "weight_gib"}]}, the measured rows in order (failed rows left out)."""
    return {"rows": [dict(path=summary_row_path(r), decode_latency_ms=r["decode_latency_ms"],
                          output_tok_s=r["output_tok_s"], weight_gib=r.get("weights_gib"))
                     for r in rows if engine_rows.row_ok(r)]}


# ---- the rows: what engine_rows.WeightRows runs ------------------------------------------------

class Weights(engine_rows.WeightRows):
    name, tag = "weights", "WEIGHTS_ROW"
    kernel_patterns = (
        (re.compile(r"quartet2: NVFP4 path marlin\b"), "Marlin FP4 W4A16 (quartet2 marlin)"),
        (re.compile(r"quartet2: GEMMs of 1-(\d+) tokens run the native few-token kernel"),
         "few-token mma kernel (1-{0} tokens)"),
        (re.compile(r"quartet2: NVFP4 path emulate\b"), "W4A4 emulation (quartet2 emulate)"),
        (re.compile(r"Selected (\w+) for Fp8\w*LinearMethod"), "{0}"),
        (re.compile(r"Using (\w+) for NVFP4 GEMM"), "{0}"),  # modelopt_fp4's kernel
    )
    order_labels = ORDER
    ours = OURS
    dtype = "bfloat16"
    meta_extra = dict(load_format="dummy")
    variant_column = ("quartet2 path", lambda r: r.get("path") or "")
    versus = ("bf16", "bf16")
    parse_method = staticmethod(parse_method)

    def identity(self, spec: str) -> dict:
        method, path = parse_method(spec)
        return dict(method=method, path=path or ("auto" if method == OURS else None), label=spec)

    def add_arguments(self, ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--model", choices=list(MODELS), default=LLAMA,
                        help="the model's shape (default: %(default)s); it sets the defaults of --methods, --prompts, "
                        "--input-len, --output-len, --layers: " + "; ".join(
                            f"{name}: {d['methods']}, {d['prompts']} x {d['input_len']} in / {d['output_len']} out, "
                            f"{d['layers']} layers" for name, d in MODELS.items()))
        ap.add_argument("--methods", help="bf16, fp8 (or another vLLM method), quartet2[:auto|marlin|emulate], "
                        "modelopt_fp4, comma-separated (default: the --model's)")
        engine_rows.add_row_arguments(ap, self.name, layers_help="decoder layers of the model's shape (default: all of "
                                 "them)")
        ap.set_defaults(prompts=None, input_len=None, output_len=None, layers=None)  # the --model's (defaults)
        ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)  # the child's: the parent's config.json

    def defaults(self, args: argparse.Namespace) -> dict:
        """The --model's (MODELS)."""
        return {key: MODELS[args.model][key] for key in ("methods", "prompts", "input_len", "output_len", "layers")}

    def check_arguments(self, ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        if args.child and not args.model_dir:
            ap.error("--child needs --model-dir")

    def model(self, args: argparse.Namespace) -> dict:
        return model_config(args.layers, args.input_len, args.output_len, args.model)

    def model_name(self, args: argparse.Namespace) -> str:
        return args.model

    def settings(self, args: argparse.Namespace) -> dict:
        return dict(super().settings(args), model_name=args.model)

    @contextlib.contextmanager
    def model_dirs(self, args: argparse.Namespace, model: dict) -> Iterator[Callable[[str], Path]]:
        """The rows' model folders (row_model_dir), in a temporary folder while they run."""
        with tempfile.TemporaryDirectory(prefix="turboquant-weights-model-") as folder:
            yield lambda spec: row_model_dir(spec, model, Path(folder))

    def child_arguments(self, args: argparse.Namespace, model_dir: str | Path) -> list[str]:
        return ["--model", args.model, "--model-dir", str(model_dir)]

    def child_model_dir(self, args: argparse.Namespace) -> Path:
        return args.model_dir

    @contextlib.contextmanager
    def environment(self, method: str, variant: str | None) -> Iterator[dict]:
        """quartet2's path (row_env) and a fresh VLLM_CACHE_ROOT, removed after the row."""
        cache = Path(tempfile.mkdtemp(prefix="turboquant-weights-vllm-cache-"))
        try:
            yield common.child_env(dict(os.environ, VLLM_CACHE_ROOT=str(cache), **row_env(method, variant)))
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    def prepare_child(self, method: str, variant: str | None, config: dict) -> None:
        check_architecture(config["architectures"][0])
        if method == OURS:  # the entry point registers it once installed; a source tree may lack the entry point
            os.environ.update(row_env(method, variant))  # the parent sets it too; this keeps a child run by hand right
            from turboquant_vllm.quant.quartet2 import register

            register()

    def llm_kwargs(self, method: str, variant: str | None, model_dir: str, input_len: int, output_len: int,
                   gpu_memory_utilization: float) -> dict:
        """The config's shape with dummy bf16 weights, quantized as the row says (bf16: not at all)."""
        kwargs = dict(super().llm_kwargs(method, variant, model_dir, input_len, output_len, gpu_memory_utilization),
                      load_format="dummy")
        if method != BF16:
            kwargs["quantization"] = method
        return kwargs

    def child_facts(self, method: str) -> dict:
        return {"kernel": BF16_KERNEL} if method == BF16 else {}  # no log line names bf16's

    def add_ratios(self, rows: list[dict]) -> str:
        """Each row against the bf16 row: output_tok_s_vs_bf16 (its tok/s / bf16's) and decode_speed_vs_bf16 (bf16's
        batch-1 decode latency / its own): > 1 is faster; none where bf16 failed or is absent."""
        ref = next((r for r in rows if r.get("label") == BF16 and engine_rows.row_ok(r)), None)
        engine_rows.add_row_ratios(rows, ref, ref if ref and ref.get("decode_latency_ms") else None, "bf16")
        return (" Ratios: against the bf16 row, > 1 faster" + ("" if ref else " (no bf16 row measured: no ratios)")
                + ". Kernel: the one the engine's log names (bf16: no log line; quartet2 marlin: NVFP4 weights "
                "through vLLM's Marlin FP4 kernel, bf16 activations; with the native few-token kernel built, GEMMs of "
                "up to its token count run on it). Weights GiB: the engine's \"Model loading took\" "
                "(embeddings and LM head bf16 in every row).")

    def intro(self, rows: list[dict], model: dict) -> str:
        return (f"Weight quantization in vLLM end to end vs bf16 weights, {model_title(model)} shape: "
                f"{engine_rows.shape_text(model)}; vLLM's dummy weights (random bf16), quantized after loading"
                + ("; modelopt_fp4: random NVFP4 parameters loaded as they are" if any(
                    r.get("method") == MODELOPT for r in rows) else "") + ".")

    def plot_title(self, model: dict) -> str:
        return f"Weight quantization in vLLM vs bf16, {model_title(model)} shape"

    def kernel_label(self, kernel: str) -> str:
        return (kernel.replace("LinearKernel", "").replace("LinearMethod ", "\n").replace("ScaledMM", "\nScaledMM")
                .replace(" (quartet2 ", "\n("))

    def summary_path(self, args: argparse.Namespace, stem: Path) -> Path | None:
        """cloverlm-4b's: benchmarks/results/quartet2.json, <stem>-quartet2.json with --out; llama3-8b: none."""
        if args.model != CLOVERLM:
            return None
        return common.with_ext(stem, "-quartet2.json") if args.out else SUMMARY

    def write_summary(self, path: Path, rows: list[dict]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary(rows), indent=1) + "\n")


BENCH = Weights()
main = BENCH.main


if __name__ == "__main__":
    main()
