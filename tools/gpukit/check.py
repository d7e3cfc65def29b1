"""Checks the kit on the GPU machine: versions, CUDA, a matmul, and the requirements of what the kit carries.

The requirement check is pip check's, in pure Python: for every distribution under the kit's site folder,
each Requires-Dist (markers evaluated, extras left out) must be met by what the path holds, kit first.
"""

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

SITE = Path(os.environ.get("GPUKIT_SITE", "/tmp/site"))
# Not counted: vLLM's kernel packages that it imports lazily and the kit leaves out, and torch's CUDA library
# pins, which the image's libraries stand in for (README.md says why).
LEFT_OUT = {canonicalize_name(n) for n in (
    "flashinfer-python", "tilelang", "nvidia-cutlass-dsl", "quack-kernels", "humming-kernels", "tokenspeed-mla",
    "PyNvVideoCodec", "torchcodec", "fastsafetensors", "instanttensor", "nvidia-cudnn-frontend", "nvtx", "anthropic",
    "mcp", "numba", "ninja", "cuda-toolkit", "nvidia-cudnn-cu13", "nvidia-cusparselt-cu13", "nvidia-nvshmem-cu13",
    # turbomind's: its extension links only libcudart.so.12 (the optional piece carries nvidia-cuda-runtime-cu12)
    "nvidia-nccl-cu12", "nvidia-cublas-cu12", "nvidia-curand-cu12")}


def requirements():
    problems, left_out = [], set()
    for dist_info in sorted(SITE.glob("*.dist-info")):
        dist = md.Distribution.at(dist_info)
        name = dist.metadata["Name"]
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker and not req.marker.evaluate({"extra": ""}):
                continue
            if canonicalize_name(req.name) in LEFT_OUT:
                left_out.add(req.name)
                continue
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                problems.append(f"{name} needs {req}: missing")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{name} needs {req}: have {have}")
    return problems, left_out


def undefined_symbols():
    """Symbols torch's CUDA libraries need that the libraries they load (the image's, NCCL the kit's) lack."""
    lines = []
    for lib in ("libc10_cuda.so", "libtorch_cuda.so", "libtorch_cuda_linalg.so", "libtorch_nvshmem.so"):
        out = subprocess.run(["ldd", "-r", str(SITE / "torch" / "lib" / lib)], check=False,
                             capture_output=True, text=True)
        # torch's own symbols (c10::, at::, torch::) come from libraries torch loads before this one.
        lines += [f"{lib}: {ln.strip()}" for ln in (out.stdout + out.stderr).splitlines()
                  if "not found" in ln or "undefined symbol" in ln and not any(
                      f" {m}" in ln for m in ("_ZN3c10", "_ZNK3c10", "_ZN2at", "_ZNK2at", "_ZN5torch", "_ZNK5torch"))]
    return lines


def main():
    import torch
    import triton
    import vllm

    print(f"python {sys.version.split()[0]}  torch {torch.__version__} (CUDA {torch.version.cuda})  "
          f"triton {triton.__version__}  vllm {vllm.__version__}")
    for mod in (torch, triton, vllm):
        if not str(mod.__file__).startswith(str(SITE)):
            print(f"check: {mod.__name__} comes from {mod.__file__}, not from the kit")
    print(f"cuda available: {torch.cuda.is_available()}")
    if torch.cuda.is_available():
        print(f"device: {torch.cuda.get_device_name()}  nccl {'.'.join(map(str, torch.cuda.nccl.version()))}  "
              f"cudnn {torch.backends.cudnn.version()}")
        a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
        err = (a @ a.T - (a.float() @ a.float().T)).abs().max().item()
        print(f"matmul: bf16 256x256, max error vs fp32 {err:.3f}")
    if (SITE / "turbomind").is_dir():  # the optional turbomind piece: its extension and libcudart.so.12 load
        import turbomind.linear

        print(f"turbomind {md.version('turbomind')}: extension "
              f"{'loaded' if turbomind.linear.TURBOMIND_EXTENSION_INSTALLED else 'NOT loaded (its error is above)'}")
    missing = undefined_symbols()
    for ln in missing[:40]:
        print(f"symbol: {ln}")
    print(f"check: {len(missing)} undefined symbol(s) or missing libraries in torch's CUDA libraries")
    problems, left_out = requirements()
    print(f"not counted (left out, or the image's libraries): {', '.join(sorted(left_out))}")
    for p in problems:
        print(f"requirement: {p}")
    print(f"check: {len(problems)} unmet requirement(s)")


if __name__ == "__main__":
    main()
