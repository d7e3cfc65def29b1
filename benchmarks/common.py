"""What the benchmarks share: where results go, the provenance every result file records, timing and plots.

Result paths: benchmarks/results/<benchmark>/<gpu>-<what>.<ext> (result_stem), <gpu> the lowercase short name of
the GPU (gpu_tag: "h200", "h100"; "cpu" without one) and <what> the configuration; --out (add_out_argument)
overrides the path. Every JSON a benchmark writes carries a "meta" object (provenance()), every Markdown file a
header line saying the same (markdown_header()); benchmarks that only print start with that header, so their logs
carry it too (print_header()).

Nothing here imports torch at import time: parents that spawn vLLM children (e2e, quality, profile_decode, awq,
weights) must not create a CUDA context of their own. The end-to-end rows in vLLM that awq and weights share are in
benchmarks.engine_rows.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PACKAGES = ("torch", "triton", "vllm", "turboquant-vllm")
SUFFIXES = (".json", ".md", ".png", ".log")
VENDOR_WORDS = {"nvidia", "tesla", "geforce", "quadro"}


# ---- the command line and the tree -----------------------------------------------------------

def parser(name: str, doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser: named as it is run, its module docstring as the help."""
    return argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def command_line(name: str, argv: list[str] | None) -> str:
    """How to repeat this call from the repository root: python -m benchmarks <name> <args>."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python -m benchmarks", name, *map(shlex.quote, args)])


@functools.lru_cache(maxsize=None)
def git_commit() -> str | None:
    """`git rev-parse --short HEAD` of the tree, "-dirty" when tracked files differ from it; None outside git.
    BENCHMARK_COMMIT overrides (a copy of the tree without .git, e.g. on a lent GPU machine)."""
    if os.environ.get("BENCHMARK_COMMIT"):
        return os.environ["BENCHMARK_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


# ---- the GPU ----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def gpu_info() -> dict:
    """name, driver, count of the GPUs (the first one's name and driver): nvidia-smi first (it creates no CUDA
    context), torch.cuda otherwise; all None without a GPU."""
    info = dict(name=None, driver=None, count=0)
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True, timeout=60).stdout
        gpus = [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]
        if gpus:
            return dict(name=gpus[0][0], driver=gpus[0][1] if len(gpus[0]) > 1 else None, count=len(gpus))
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import torch

        if torch.cuda.is_available():
            info.update(name=torch.cuda.get_device_name(), count=torch.cuda.device_count())
    except ImportError:
        pass
    return info


def gpu_tag(name: str | None = None) -> str:
    """The lowercase short name of a GPU for file names: "NVIDIA H200" -> h200, "NVIDIA H100 80GB HBM3" -> h100,
    "NVIDIA A100-SXM4-80GB" -> a100, "NVIDIA GeForce RTX 4090" -> rtx4090; cpu without a GPU."""
    name = gpu_info()["name"] if name is None else name
    if not name:
        return "cpu"
    words = [w for w in re.split(r"\s+", name.lower()) if w and w not in VENDOR_WORDS]
    if not words:
        return "gpu"
    if words[0] in ("rtx", "gtx") and len(words) > 1:
        words = [words[0] + words[1]]
    return re.sub(r"[^a-z0-9]+", "", words[0].split("-")[0]) or "gpu"


# ---- provenance ------------------------------------------------------------------------------

def package_versions() -> dict[str, str | None]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def provenance(command: str) -> dict:
    """What every result file records: the command line, the commit of the tree, the GPU and its driver, the CUDA
    runtime torch was built with, the package versions and when."""
    gpu = gpu_info()
    cuda = None
    try:
        import torch

        cuda = torch.version.cuda
    except ImportError:
        pass
    return dict(command=command, commit=git_commit(), gpu=gpu["name"], gpu_count=gpu["count"], driver=gpu["driver"],
                cuda=cuda, python=sys.version.split()[0], versions=package_versions(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def markdown_header(meta: dict) -> str:
    """One line of provenance, the first of every Markdown result."""
    versions = ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items() if v)
    gpu = meta.get("gpu") or "no GPU"
    if meta.get("gpu_count", 0) > 1:
        gpu = f"{meta['gpu_count']}x {gpu}"
    driver = ", ".join(x for x in (f"driver {meta['driver']}" if meta.get("driver") else "",
                                   f"CUDA {meta['cuda']}" if meta.get("cuda") else "") if x)
    return (f"<sub>`{meta.get('command')}` at commit {meta.get('commit') or 'unknown'}; {gpu}"
            f"{f' ({driver})' if driver else ''}; {versions}; {meta.get('date')}</sub>\n\n")


def print_header(command: str) -> dict:
    """For benchmarks that print their results: the provenance first, so a captured log carries it."""
    meta = provenance(command)
    print(markdown_header(meta).replace("<sub>", "# ").replace("</sub>", "").strip(), flush=True)
    return meta


# ---- vLLM's own compressed KV caches ------------------------------------------------------------

# vLLM 0.33's compressed caches that run on Hopper (sm_90) with the GPU kit: kv_cache_dtype -> the attention backend
# to ask for (None: let vLLM pick). On sm_90 vLLM tries FLASH_ATTN, FLASHINFER, TRITON_ATTN, FLEX_ATTENTION,
# TURBOQUANT in turn (platforms/cuda.py _get_backend_priorities) and takes the first whose
# supported_kv_cache_dtypes holds the dtype: TRITON_ATTN for the per-token-head ones, TURBOQUANT for turboquant_*.
# The turboquant_* are left to that pick: vLLM keeps their first and last two layers in bf16 (engine/arg_utils.py,
# TurboQuantConfig.get_boundary_skip_layers), which TURBOQUANT cannot run, so forcing it fails on those layers.
VLLM_KV = {
    "int4_per_token_head": "TRITON_ATTN",  # Hadamard-rotated int4, fp32 scale with the zero point in its low bits
    "int8_per_token_head": "TRITON_ATTN",
    "fp8_per_token_head": "TRITON_ATTN",
    "turboquant_k8v4": None,
    "turboquant_4bit_nc": None,
    "turboquant_k3v4_nc": None,
    "turboquant_3bit_nc": None,
}
# Those that do not run on an H100 / H200 with the GPU kit, and why (one line each in every KV-cache report).
VLLM_KV_NOT_ON_HOPPER = (
    ("ultraquant_4bit", ("ROCm only: no CUDA backend list holds ULTRAQUANT (platforms/rocm.py does), its decode is "
                         "FlyDSL (gfx950) or tl.dot_scaled, and forcing it fails on its bf16 boundary layers")),
    ("nvfp4", ("FLASHINFER only (its fa2 path on sm_90, not at head_dim 64): needs flashinfer-python, which the GPU "
               "kit does not carry")),
    ("nvfp4_4over6", "FLASHINFER's trtllm-gen kernels on sm_100 only (its scale search has no sm_90 writer)"),
)


def not_on_hopper_markdown() -> str:
    """The report lines for vLLM's compressed caches left out on Hopper."""
    return "vLLM's compressed KV caches not measured (they do not run on an H100 / H200 with the GPU kit):\n" + "".join(
        f"- `{name}`: {why}\n" for name, why in VLLM_KV_NOT_ON_HOPPER)


def vllm_bytes_per_token_per_head(kv_cache_dtype: str, head_dim: int) -> int:
    """K+V bytes per token per KV head of one layer in vLLM's compressed cache, from vLLM's own page arithmetic: the
    backend's customize_spec on a one-token, one-head FullAttentionSpec (as platforms/interface.py sizes pages)."""
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    backend = AttentionBackendEnum[VLLM_KV[kv_cache_dtype] or "TURBOQUANT"].get_class()  # turboquant_*'s layers
    spec = FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=head_dim,
                             dtype=STR_DTYPE_TO_TORCH_DTYPE[kv_cache_dtype],
                             kv_quant_mode=get_kv_quant_mode(kv_cache_dtype))
    return backend.customize_spec(spec).page_size_bytes


# ---- result paths and files ------------------------------------------------------------------

def result_stem(benchmark: str, what: str, gpu: str | None = None) -> Path:
    """benchmarks/results/<benchmark>/<gpu>-<what>: the results' path without its extension."""
    return RESULTS / benchmark / f"{gpu or gpu_tag()}-{what}"


def add_out_argument(ap: argparse.ArgumentParser, default: str) -> None:
    ap.add_argument("--out", type=Path, help=f"result files' path, extension left out or not (default: {default})")


def stem_of(path: Path | str) -> Path:
    """--out as given, a known extension (.json, .md, .png, .log) left out."""
    path = Path(path)
    return path.with_suffix("") if path.suffix in SUFFIXES else path


def with_ext(stem: Path, ext: str) -> Path:
    """stem + ext, whatever dots the stem's name holds."""
    return stem.parent / (stem.name + ext)


def write_json(path: Path, doc: dict, meta: dict) -> None:
    """doc with its provenance under "meta" (keys already there are kept: a benchmark's own settings)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = dict(doc, meta={**meta, **doc.get("meta", {})})
    path.write_text(json.dumps(doc, indent=1) + "\n")


def write_markdown(path: Path, text: str, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown_header(meta) + text)


def shape_tag(batch: int, context: int) -> str:
    """64, 8192 -> 64x8k (contexts that are not multiples of 1024 stay as they are)."""
    return f"{batch}x{context // 1024}k" if context % 1024 == 0 else f"{batch}x{context}"


# ---- timing ------------------------------------------------------------------------------------

def time_ms(fn, cuda_graph: bool = True, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of fn on the GPU: replayed from a CUDA graph (launch overhead out), or launched as is
    (what vLLM runs uncaptured, e.g. prefill steps)."""
    import torch
    import triton

    # do_bench_cudagraph runs fn on a stream of its own, which does not wait for the default stream: without this,
    # fn could read a cache or block table whose writes (store_kv, host copies) are still queued there. It did: an
    # illegal address in decode_sweep, gone under CUDA_LAUNCH_BLOCKING=1 (NOTES.md).
    torch.cuda.synchronize()
    if cuda_graph:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


# ---- plots -------------------------------------------------------------------------------------

def grouped_bars(path: Path, rows: list[dict], series: list[str], series_key: str, groups: list, group_of,
                 group_labels: list[str], ylabel: str, title: str, figsize: tuple[float, float]) -> None:
    """One bar per series in each group: the time_ms of the row whose series_key is the series and group_of(row)
    the group (a gap where there is none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    width = 0.8 / len(series)
    for i, name in enumerate(series):
        ys = [next((r["time_ms"] for r in rows if r[series_key] == name and group_of(r) == g), math.nan)
              for g in groups]
        ax.bar([j + i * width for j in range(len(groups))], ys, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], group_labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- children ----------------------------------------------------------------------------------

def module_command(name: str, *args: str) -> list[str]:
    """A child process of benchmark `name`: python -m benchmarks.<name> args (run with child_env)."""
    return [sys.executable, "-m", f"benchmarks.{name}", *args]


def child_env(env: dict | None = None) -> dict:
    """env (os.environ by default) with the repository root first on PYTHONPATH, so the child finds this package
    (and reference_lm) from any working directory."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env
