"""Where quartet2's native few-token kernel (marlin_mma.cu) is built, how, and loading it: no Triton at import (nor
in this package's __init__), so `turboquant-vllm verify` can report it before any Triton kernel is imported.

Built once by a documented step, never inside a request: `python -m turboquant_vllm.quant.quartet2.kernels.marlin_mma
build [NVCC]` compiles marlin_mma.cu with nvcc (CUDA 12 or 13; sm_80 and sm_90 code) into $TURBOQUANT_NATIVE_DIR
(default ~/.cache/turboquant-vllm), one file per version of the source.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("marlin_mma.cu")
DIR_ENV = "TURBOQUANT_NATIVE_DIR"
ARCHS = ("80", "90")  # mma.sync m16n8k16 and bf16x2 FMA: Ampere and newer
BUILD_COMMAND = "python -m turboquant_vllm.quant.quartet2.kernels.marlin_mma build"


def library_path() -> Path:
    """Where the built kernel lives: one file per source version."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    root = Path(os.environ.get(DIR_ENV) or Path.home() / ".cache" / "turboquant-vllm")
    return root / f"marlin_mma-{digest}.so"


def nvcc_command(out: Path, nvcc: str = "nvcc") -> list[str]:
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    return [nvcc, "-O3", "-shared", "-Xcompiler", "-fPIC", *gencode, "-o", str(out), str(SOURCE)]


def build(nvcc: str | None = None) -> Path:
    """Compiles marlin_mma.cu into library_path() with nvcc (from $CUDA_HOME/bin or PATH); CUDA 12.x or 13.x."""
    out = library_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    if nvcc is None:
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        nvcc = str(Path(home) / "bin" / "nvcc") if home else "nvcc"
    tmp = out.with_suffix(".tmp.so")
    try:
        subprocess.run(nvcc_command(tmp, nvcc), check=True)
    except FileNotFoundError:
        raise RuntimeError(f"no nvcc at {nvcc!r}: install a CUDA toolkit (12.x or 13.x) and set CUDA_HOME, or give "
                           f"nvcc's path ({BUILD_COMMAND} /path/to/nvcc)") from None
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"nvcc failed (exit status {e.returncode}; its messages above): the kernel needs CUDA 12.x "
                           "or 13.x for sm_80 / sm_90") from None
    tmp.replace(out)
    return out


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built kernel, or None if it has not been built (the path then runs Marlin for few tokens)."""
    path = library_path()
    if not path.exists():
        return None
    lib = ctypes.CDLL(str(path))
    lib.tq_marlin_mma.restype = ctypes.c_int
    lib.tq_marlin_mma.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int,
                                                                                ctypes.c_int, ctypes.c_void_p]
    return lib
