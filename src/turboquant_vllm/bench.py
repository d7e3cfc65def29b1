"""Decode attention on this GPU: our kernels vs vLLM's FlashAttention-3 (bf16, fp8) over caches of the same contents.

Each kernel reads a cache of random K/V for `batch` sequences of `context` tokens (pages shuffled, block 16) with
one query token per sequence, is captured in a CUDA graph and timed by replay, so launch overhead is out of the
comparison for all alike. `turboquant-vllm bench` prints the table; `python -m benchmarks decode_kernel` adds vLLM's
in-tree TurboQuant and writes result files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .core.calibration import KeyCalibration
from .core.layout import CacheLayout
from .core.presets import get_preset
from .ops import paged_attention, store_kv
from .ops.attention import attention_workspace_shape, decode_num_splits
from .ops.rotation import rotate_queries

BLOCK = 16


@dataclass(frozen=True)
class Shape:
    batch: int
    context: int
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128

    @property
    def name(self) -> str:
        return f"{self.batch} x {self.context}"


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second: the ceiling a decode kernel is measured against."""
    import triton

    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100)
    return 2 * src.numel() / (ms * 1e-3)


def time_graph(fn: Callable[[], object]) -> float:
    """Median ms of a CUDA-graph replay of fn."""
    import triton

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=200)


class Batch:
    """One decode step's inputs and a bf16 cache in FlashAttention's layout (num_blocks, block, kv_heads, d)."""

    def __init__(self, shape: Shape, gen: torch.Generator, device: str = "cuda"):
        self.shape = s = shape
        blocks_per_seq = -(-s.context // BLOCK)
        self.num_blocks = s.batch * blocks_per_seq
        perm = torch.randperm(self.num_blocks, generator=gen)
        self.block_table = perm.view(s.batch, blocks_per_seq).to(torch.int32).to(device)
        self.seq_lens = torch.full((s.batch,), s.context, dtype=torch.int32, device=device)
        self.qsl = torch.arange(s.batch + 1, dtype=torch.int32, device=device)
        self.query = torch.randn(s.batch, s.q_heads, s.head_dim, generator=gen).to(torch.bfloat16).to(device)
        # on the device's own generator: gigabytes at long contexts
        self.k_cache = torch.randn(self.num_blocks, BLOCK, s.kv_heads, s.head_dim, dtype=torch.bfloat16, device=device)
        self.v_cache = torch.randn_like(self.k_cache)

    def slot_chunks(self, chunk_blocks: int = 4096):
        """(physical block ids, K, V) in chunks: token order within a block is the slot offset."""
        for b0 in range(0, self.num_blocks, chunk_blocks):
            ids = torch.arange(b0, min(b0 + chunk_blocks, self.num_blocks), device=self.k_cache.device)
            yield ids, self.k_cache[ids].flatten(0, 1), self.v_cache[ids].flatten(0, 1)

    def bytes_moved(self, bytes_per_token_per_head: float) -> float:
        """What a kernel must read and write: the context's KV bytes, the block table, the query and the output."""
        s = self.shape
        meta = self.block_table.numel() * 4 + 2 * self.query.numel() * 2
        return s.batch * s.context * s.kv_heads * bytes_per_token_per_head + meta


def ours(b: Batch, preset: str, splits: int | None = None, calibrated: bool = False, served: bool = False,
         **tuning) -> tuple[Callable[[], object], int]:
    """Our decode attention over the batch's contents stored in `preset`; (launch, bytes per token per KV head).
    calibrated: keys stored with a key calibration (a mean near the keys' and a scale), so the pages hold centered
    and uncentered tokens and decode takes its calibrated path. served: the queries rotated once beforehand, as the
    vLLM backend's store launch rotates them with the step's keys (decode + merge launched; else rotation too)."""
    s = b.shape
    layout = CacheLayout(get_preset(preset), s.head_dim, s.kv_heads, BLOCK)
    cache = torch.empty(layout.cache_shape(b.num_blocks), dtype=torch.uint8, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    cal = KeyCalibration(torch.randn(s.kv_heads, s.head_dim, device="cuda", generator=gen),
                         torch.rand(s.kv_heads, s.head_dim, device="cuda", generator=gen) + 0.5) if calibrated else None
    for ids, k, v in b.slot_chunks():
        slots = (ids[:, None] * BLOCK + torch.arange(BLOCK, device="cuda")).flatten()
        store_kv(k, v, cache, slots, layout, cal)
    splits = splits or decode_num_splits(s.batch, layout)
    ws = torch.empty(attention_workspace_shape(s.batch, s.q_heads, s.head_dim, splits), dtype=torch.float32,
                     device="cuda")
    out = torch.empty_like(b.query)
    rotated = rotate_queries(b.query, layout, s.head_dim**-0.5, cal, torch.float16) if served else None

    def run():
        paged_attention(b.query, cache, layout, b.block_table, b.qsl, b.seq_lens, max_query_len=1,
                        scale=s.head_dim**-0.5, out=out, workspace=ws, num_splits=splits, key_calibration=cal,
                        rotated_query=rotated, **tuning)
    return run, layout.bytes_per_token_per_head


def flash(b: Batch, fp8: bool) -> tuple[Callable[[], object], int]:
    """vLLM's FlashAttention-3 over the bf16 cache (or its fp8 cast, as vLLM's fp8 KV cache with unit scales)."""
    from .vllm import compat

    flash_attn_varlen_func, _ = compat.flash_attn_varlen()
    s = b.shape
    k, v, q = b.k_cache, b.v_cache, b.query
    kw = {}
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        q = q.to(torch.float8_e4m3fn)  # vLLM quantizes queries for the fp8 cache
        ones = torch.ones(s.batch, s.kv_heads, dtype=torch.float32, device="cuda")
        kw = dict(q_descale=ones, k_descale=ones, v_descale=ones)
    out = torch.empty(s.batch, s.q_heads, s.head_dim, dtype=torch.bfloat16, device="cuda")

    def run():
        flash_attn_varlen_func(q, k, v, max_seqlen_q=1, cu_seqlens_q=b.qsl, max_seqlen_k=s.context,
                               seqused_k=b.seq_lens, softmax_scale=s.head_dim**-0.5, causal=True,
                               block_table=b.block_table, out=out, fa_version=3, **kw)
    return run, 2 * s.head_dim * (1 if fp8 else 2)


def flash_available() -> str | None:
    """None if vLLM's FlashAttention-3 can run here, else why not (our kernels need no vLLM)."""
    try:
        from .vllm import compat
    except (ImportError, RuntimeError) as e:  # no vLLM, or one outside the supported range
        return f"vLLM is not usable here ({type(e).__name__}: {str(e)[:160]})"
    found = compat.flash_attn_varlen()
    if found is None:
        return "vLLM's FlashAttention is not importable here"
    return None if found[1] == 3 else f"vLLM picks FlashAttention {found[1]} here; the baselines need version 3"


def measure(b: Batch, kernels: dict[str, Callable[[], tuple[Callable[[], object], int]]], peak: float,
            log: Callable[[str], None] = print) -> list[dict]:
    """Time each kernel on the batch; speed-up against "fa3_bf16" when it ran first. A kernel that fails to
    build or run is logged and left out, not hidden."""
    rows, base = [], None
    s = b.shape
    for name, make in kernels.items():
        try:
            fn, per_token = make()
            ms = time_graph(fn)
        except Exception as e:
            log(f"{name} {s.name}: failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        base = ms if name == "fa3_bf16" else base
        moved = b.bytes_moved(per_token)
        rows.append(dict(kernel=name, batch=s.batch, context=s.context, q_heads=s.q_heads, kv_heads=s.kv_heads,
                         head_dim=s.head_dim, time_ms=ms, gbps=moved / ms / 1e6, bytes_moved=moved,
                         frac_of_copy_bw=moved / (ms * 1e-3) / peak, speedup_vs_bf16=(base / ms) if base else None))
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = ["| kernel | batch x context | time (ms) | GB/s | of copy BW | speed-up vs FA3 bf16 |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        gb = f"{r['gbps']:.0f}" if r.get("gbps") else ""
        fr = f"{r['frac_of_copy_bw']:.0%}" if r.get("frac_of_copy_bw") else ""
        sp = f"{r['speedup_vs_bf16']:.2f}x" if r.get("speedup_vs_bf16") else ""
        lines.append(f"| {r['kernel']} | {r['batch']} x {r['context']} | {r['time_ms']:.4f} | {gb} | {fr} | {sp} |")
    return lines
