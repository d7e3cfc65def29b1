"""`turboquant-vllm cloverlm MODEL_DIR`: a CloverLM checkpoint served by vLLM, offline (greedy generations for
--prompt texts, printed) or through vLLM's OpenAI-compatible server (--api). The architecture comes from this
package's vLLM entry point (models.cloverlm.register), so API mode execs `vllm serve` as the serve command does.

The checkpoint's own weights decide the quantization (bf16, or CloverLM's NVFP4 with hf_quant_config.json, which
vLLM hands to quartet2 by itself); --quantization quartet2 quantizes bf16 weights to NVFP4 on the fly. --kv-preset
swaps vLLM's bf16 KV cache for TurboQuant's (attention backend CUSTOM, the preset in vLLM's additional_config, the
channel vLLM keys its compile cache by).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

from .arguments import UsageError, _fraction, _positive, _preset, require_vllm

ARCH = "CloverLMForCausalLM"
DEFAULT_PROMPTS = ("The capital of France is", "Large language models are", "In the year 2030,")
DEFAULT_MAX_TOKENS = 64
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _kv_preset(text: str) -> str | None:
    """argparse type: "none" (vLLM's bf16 KV cache) or a TurboQuant preset name."""
    return None if text.strip().lower() == "none" else _preset(text)


def _port(text: str) -> int:
    port = _positive(int)(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in 1..65535, got {text!r}")
    return port


def add_parser(sub, preset_names: list[str]) -> None:
    c = sub.add_parser("cloverlm", help="serve a CloverLM checkpoint with vLLM: offline generations or the OpenAI API",
                       description="Serve a local CloverLM checkpoint (config.json with architecture "
                       f"{ARCH}, a tokenizer, bf16 or CloverLM NVFP4 weights) with vLLM, CUDA graphs on. Offline "
                       "(default): greedy generations for the --prompt texts, printed. --api: vLLM's OpenAI-compatible "
                       "server (vllm serve). Needs vLLM 0.33 and an NVIDIA GPU.")
    c.add_argument("model", metavar="MODEL_DIR", help="local CloverLM checkpoint directory")
    c.add_argument("--api", action="store_true", help="run vLLM's OpenAI-compatible server instead of generating")
    c.add_argument("--host", help="--api: address to listen on (default 127.0.0.1)")
    c.add_argument("--port", type=_port, help="--api: port (default 8000)")
    c.add_argument("--tp", type=_positive(int), default=1, metavar="N",
                   help="tensor-parallel size (default %(default)s)")
    c.add_argument("--max-model-len", type=_positive(int), metavar="TOKENS",
                   help="context length (default: the checkpoint's)")
    c.add_argument("--gpu-memory-utilization", type=_fraction, metavar="FRACTION",
                   help="fraction of GPU memory vLLM may take (default: vLLM's, 0.9)")
    c.add_argument("--kv-preset", type=_kv_preset, default=None, metavar="PRESET",
                   help=f"KV cache: none (default: vLLM's bf16 cache) or a TurboQuant preset "
                   f"({', '.join(preset_names)}), served by attention backend CUSTOM with --additional-config "
                   "turboquant_preset (TURBOQUANT_PRESET, the preset's default, is not read)")
    c.add_argument("--quantization", choices=["quartet2"],
                   help="quartet2: quantize bf16 weights to NVFP4 on the fly (default: as the checkpoint is)")
    c.add_argument("--trust-remote-code", action="store_true",
                   help="allow a tokenizer that is remote code (tokenizer_config.json auto_map, as CloverLM's "
                   "release has)")
    c.add_argument("--prompt", action="append", metavar="TEXT",
                   help="offline: a prompt, completed as plain text; repeat for several (default: three built-in)")
    c.add_argument("--max-tokens", type=_positive(int), metavar="N",
                   help=f"offline: new tokens per prompt at most (default {DEFAULT_MAX_TOKENS})")


# ----------------------------------------------------------------------------------------------------------------
# The checkpoint
# ----------------------------------------------------------------------------------------------------------------

def read_config(model_dir: Path) -> dict:
    """config.json of a CloverLM checkpoint directory, or a UsageError saying what it is not."""
    if not model_dir.is_dir():
        raise UsageError(f"{model_dir}: no such directory (give a local CloverLM checkpoint directory)")
    path = model_dir / "config.json"
    if not path.is_file():
        raise UsageError(f"{model_dir}: no config.json (not a Hugging Face checkpoint directory)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: not readable JSON ({exc})") from None
    archs = config.get("architectures") or []
    if ARCH not in archs:
        raise UsageError(f"{model_dir}: config.json names architectures {archs}, not {ARCH} (serve other models with "
                         "turboquant-vllm serve)")
    return config


def tokenizer_kind(model_dir: Path) -> str | None:
    """"files" (tokenizer.json and the like), "remote" (only tokenizer_config.json's auto_map: remote code) or None."""
    if any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        return "files"
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    return "remote" if (config.get("auto_map") or {}).get("AutoTokenizer") else None


def quant_config(model_dir: Path, config: dict) -> dict | None:
    """The checkpoint's quantization config: config.json's quantization_config, else hf_quant_config.json (what vLLM
    reads)."""
    if config.get("quantization_config"):
        return config["quantization_config"]
    try:
        return json.loads((model_dir / "hf_quant_config.json").read_text())
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------------------------------------------
# What vLLM is asked for
# ----------------------------------------------------------------------------------------------------------------

def check(args: argparse.Namespace) -> tuple[Path, dict]:
    """The checkpoint directory and its config, every argument checked against it; UsageError otherwise."""
    model_dir = Path(args.model).expanduser()
    config = read_config(model_dir)
    kind = tokenizer_kind(model_dir)
    if kind is None:
        raise UsageError(f"{model_dir}: no tokenizer (vLLM needs one beside the weights: tokenizer.json, or "
                         "tokenizer_config.json naming the tokenizer's code); copy the model's tokenizer files in")
    if kind == "remote" and not args.trust_remote_code:
        raise UsageError(f"{model_dir}: the tokenizer is remote code (tokenizer_config.json auto_map); pass "
                         "--trust-remote-code to run it")
    if args.api and (args.prompt or args.max_tokens):
        raise UsageError("--prompt and --max-tokens are for offline generation; with --api the requests say them")
    if not args.api and (args.host or args.port):
        raise UsageError("--host and --port are for the API server: add --api")
    heads = config.get("heads", config.get("num_attention_heads"))
    if isinstance(heads, int) and heads % args.tp:
        raise UsageError(f"--tp {args.tp}: CloverLM's {heads} attention heads do not split evenly over {args.tp} "
                         "GPUs")
    from ..quant.quartet2.plugin.checkpoint import is_cloverlm_nvfp4

    if is_cloverlm_nvfp4(quant_config(model_dir, config)) and args.tp > 1:
        raise UsageError(f"--tp {args.tp}: an NVFP4 checkpoint's blocked scales do not split over GPUs; serve it "
                         "with --tp 1, or serve the bf16 checkpoint with --quantization quartet2")
    if args.kv_preset:
        from ..core.layout import CacheLayout
        from ..core.presets import get_preset

        d_head = config.get("d_head", config.get("head_dim"))
        try:
            CacheLayout(get_preset(args.kv_preset), int(d_head), 1, 16)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"--kv-preset {args.kv_preset}: CloverLM's head dimension {d_head}: "
                             f"{str(exc).split(';')[0]}") from None
    return model_dir, config


def engine_args(args: argparse.Namespace, model_dir: Path) -> dict:
    """vLLM's engine arguments (LLM's keywords; the flags of `vllm serve` by api_command), None left out."""
    from ..vllm.settings import PRESET_CONFIG_KEY

    out = {"model": str(model_dir), "tensor_parallel_size": args.tp, "dtype": "bfloat16",
           "max_model_len": args.max_model_len, "gpu_memory_utilization": args.gpu_memory_utilization,
           "quantization": args.quantization, "trust_remote_code": args.trust_remote_code or None}
    if args.kv_preset:
        out["attention_backend"] = "CUSTOM"
        out["additional_config"] = {PRESET_CONFIG_KEY: args.kv_preset}
    return {k: v for k, v in out.items() if v is not None}


def engine_env(args: argparse.Namespace, env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """env, made the environment of vLLM's processes: --kv-preset goes through additional_config, so a
    TURBOQUANT_PRESET there would be a second preset (refused by the backend where the two differ)."""
    from ..vllm.settings import PRESET_ENV

    if args.kv_preset:
        env.pop(PRESET_ENV, None)
    return env


def api_command(args: argparse.Namespace, engine: dict) -> list[str]:
    """`vllm serve` (this interpreter's vLLM, as cmd_serve runs it) with the engine arguments as flags."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", engine["model"],
           "--host", args.host or "127.0.0.1", "--port", str(args.port or 8000)]
    for key, value in engine.items():
        if key == "model":
            continue
        flag = "--" + key.replace("_", "-")
        cmd += [flag] if value is True else [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return cmd


def generate(engine: dict, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy generations from vLLM in this process (its engine processes inherit the environment)."""
    from vllm import LLM, SamplingParams

    kwargs = dict(engine)
    if "attention_backend" in kwargs:
        kwargs["attention_config"] = {"backend": kwargs.pop("attention_backend")}
    llm = LLM(seed=0, **kwargs)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def cmd_cloverlm(args: argparse.Namespace) -> int:
    model_dir, _ = check(args)
    require_vllm("cloverlm")
    engine = engine_args(args, model_dir)
    if args.api:
        cmd = api_command(args, engine)
        sys.stdout.flush()
        os.execvpe(cmd[0], cmd, engine_env(args, dict(os.environ)))  # vLLM's server replaces this process
    else:
        engine_env(args, os.environ)  # vLLM's engine processes started below inherit it
        prompts = args.prompt or list(DEFAULT_PROMPTS)
        texts = generate(engine, prompts, args.max_tokens or DEFAULT_MAX_TOKENS)
        for prompt, text in zip(prompts, texts, strict=True):
            print(f"prompt: {prompt}\ngenerated: {text}\n", flush=True)
    return 0
