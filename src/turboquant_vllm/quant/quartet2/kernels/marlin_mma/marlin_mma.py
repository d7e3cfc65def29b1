"""The marlin path's few-token GEMM: a native kernel (marlin_mma.cu) that feeds mma.sync straight from Marlin's NVFP4
words, for 1 to 8 tokens (the marlin path gives it up to POLICY_TOKENS: batch-1 and small-batch decode).

Each Marlin word is the A fragment of one mma.m16n8k16 once decoded (the weight as A, x as B with the tokens as its
8 columns), so a lane loads 4 consecutive words and decodes them in registers: no shared memory, no layout change,
the weight stored once. Decoding is exact (code * scale fits bf16 and fp16), the tensor cores sum in fp32, and the
order of every sum is fixed (warps, then K splits in split order), so a call's result does not depend on timing. On
sm_90 the splits of an n-tile run as one thread-block cluster and are added from their shared memory (up to
MAX_CLUSTER splits), elsewhere through global memory: the same sums in the same order, the same bits.

The kernel is built once by a documented step (native.py: nvcc for sm_80 / sm_90; `python -m
turboquant_vllm.quant.quartet2.kernels.marlin_mma build`) into $TURBOQUANT_NATIVE_DIR (default
~/.cache/turboquant-vllm), never inside a request; without the library the path runs Marlin for these token counts.
naive.emulate is its arithmetic in plain PyTorch, bit for bit.
"""

from __future__ import annotations

import functools

import torch

from ..marlin_layout import TILE_K, TILE_N
from .naive import FRAGMENT_SHIFT, WARPS, lane_scale_bytes
from .native import BUILD_COMMAND, library_path, load

MAX_TOKENS = 8  # the mma's n: what the kernel takes
POLICY_TOKENS = 8  # what the marlin path gives it: it beats Marlin up to 8 tokens (H100, nvfp4_gemm)
MAX_CLUSTER = 8  # a portable thread-block cluster: the most K splits added in one (sm_90)
CTAS_PER_SM = 3  # the split policy's target (the kernel fits 4 an SM; 3 measured best, 2 and 4-6 slower)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    """The device's compute capability, asked once: gemm needs it at every call."""
    return torch.cuda.get_device_capability(device)


def supported(device: torch.device) -> str | None:
    """None if the kernel can run on `device`, else why not: "not ..." (one line)."""
    if device.type != "cuda":
        return f"not for a {device.type} device"
    if _capability(device) < (8, 0):
        return "not for GPUs below sm_80"
    if load() is None:
        return f"not built ({BUILD_COMMAND}: needs nvcc; looked for {library_path()})"
    return None


def split_plan(padded_n: int, k: int, sms: int) -> tuple[int, int]:
    """(splits, k-tiles a split) for a layer: about CTAS_PER_SM CTAs an SM, each at least 2 k-tiles a warp."""
    n_tiles, k_tiles = padded_n // TILE_N, k // TILE_K
    splits = max(1, min(-(-CTAS_PER_SM * sms // n_tiles), k_tiles // (2 * WARPS)))
    per = -(-k_tiles // splits)
    return -(-k_tiles // per), per


_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _cuda(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def reserve_workspace(padded_n: int, k: int, device: torch.device) -> None:
    """The split partials (fp32) and the n-tiles' counters, one pair per device shared by every layer (calls run in
    stream order), grown at load time so that no CUDA graph captures an allocation."""
    device = _cuda(device)
    splits, _ = split_plan(padded_n, k, torch.cuda.get_device_properties(device).multi_processor_count)
    partial, counters = _WORKSPACES.get(device, (None, None))
    need = splits * MAX_TOKENS * padded_n
    if partial is None or partial.numel() < need:
        partial = torch.empty(need, dtype=torch.float32, device=device)
    if counters is None or counters.numel() < padded_n // TILE_N:
        counters = torch.zeros(padded_n // TILE_N, dtype=torch.int32, device=device)
    _WORKSPACES[device] = (partial, counters)


def clusters(device: torch.device, splits: int) -> bool:
    """Whether a call of `splits` K splits adds them in a thread-block cluster (sm_90 and newer, <= MAX_CLUSTER)."""
    return splits <= MAX_CLUSTER and _capability(device) >= (9, 0)


def gemm(x: torch.Tensor, codes: torch.Tensor, scale_bytes: torch.Tensor, n: int, k: int, alpha: float,
         out: torch.Tensor | None = None, cluster: bool | None = None) -> torch.Tensor:
    """alpha * x W^T for x (M <= 8, K) bf16 / fp16, W in Marlin's layout (codes int32 (K / 16, 2 padded_n), scale
    bytes (K / 16, padded_n)): the native kernel on torch's current stream, into `out` (M, N) if given; `cluster`
    (default: clusters()) picks how the K splits are added (the same bits either way)."""
    m = x.shape[0]
    if not 1 <= m <= MAX_TOKENS or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"marlin_mma takes 1-{MAX_TOKENS} tokens of bf16 / fp16, got {tuple(x.shape)} {x.dtype}")
    x = x.contiguous()
    padded_n = scale_bytes.shape[1]
    splits, per = split_plan(padded_n, k, torch.cuda.get_device_properties(x.device).multi_processor_count)
    partial, counters = _WORKSPACES.get(x.device, (None, None))
    if partial is None or partial.numel() < splits * MAX_TOKENS * padded_n or counters.numel() < padded_n // TILE_N:
        raise RuntimeError("marlin_mma: the workspace was not reserved for this layer (reserve_workspace at load)")
    if cluster is None:
        cluster = clusters(x.device, splits)
    elif cluster and not clusters(x.device, splits):
        raise ValueError(f"marlin_mma: {splits} splits on a GPU of compute capability "
                         f"{_capability(x.device)} cannot be added in a cluster (sm_90 and newer, "
                         f"<= {MAX_CLUSTER} splits)")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"marlin_mma: out must be contiguous ({m}, {n}) {x.dtype}")
    err = load().tq_marlin_mma(x.data_ptr(), codes.data_ptr(), scale_bytes.data_ptr(), partial.data_ptr(),
                               counters.data_ptr(), out.data_ptr(), m, n, k, padded_n, splits, per,
                               alpha * 2.0 ** FRAGMENT_SHIFT[x.dtype],
                               int(x.dtype == torch.bfloat16), int(cluster),
                               torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        raise RuntimeError(f"marlin_mma: launch failed with cudaError_t {err}")
    return out


def zero_flushed_codes(codes: torch.Tensor, scale_bytes: torch.Tensor) -> None:
    """Zeroes, in place, the codes of every group whose scale byte is zero (a group Marlin flushed: Marlin and the
    dense decoder read it as zeros whatever its codes), so that the kernel needs no test for it. A word holds two
    groups of its k-tile: rows n3 = 0 (nibbles 0, 1, 4, 5) and n3 = 1 (nibbles 2, 3, 6, 7)."""
    n_tiles = scale_bytes.shape[1] // TILE_N
    zero = lane_scale_bytes(scale_bytes.view(torch.uint8).reshape(-1, n_tiles, 8, 8)) == 0  # (kt, tile, g, n54, n3)
    mask = zero[..., 0].to(torch.int64) * 0x00FF00FF | zero[..., 1].to(torch.int64) * 0xFF00FF00
    words = codes.view(-1, n_tiles, 8, 4, 4)  # (kt, tile, g, t, n54)
    kept = (words.to(torch.int64) & 0xFFFFFFFF) & ~mask[:, :, :, None, :]
    words.copy_(torch.where(kept >= 2**31, kept - 2**32, kept).to(torch.int32))
