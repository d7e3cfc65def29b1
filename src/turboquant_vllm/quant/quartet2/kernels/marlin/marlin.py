"""quartet2's Hopper / Ampere fast path: NVFP4 weights through vLLM's own Marlin FP4 kernel (W4A16: activations stay
in bf16 / fp16; vllm.model_executor.layers.quantization.utils.marlin_utils_fp4).

What vLLM's NVFP4 methods hand to its Marlin helpers (ModelOpt's and compressed-tensors' W4A16 / the Marlin NVFP4
linear kernel, vLLM 0.33), all of it what an NVFP4Weight already holds:
    weight               uint8 (N, K / 2): E2M1 codes, element 2i in the low nibble, sign in bit 3 (ours as they are)
    weight_scale         float8_e4m3fn (N, K / 16), row-major (not the blocked / swizzled layout of the FP4 GEMMs)
    weight_global_scale  fp32 scalar, the multiplier (ModelOpt's weight_scale_2 = amax / 2688, not its reciprocal):
                         w = code * weight_scale * weight_global_scale, as our tensor scale is
prepare_fp4_layer_for_marlin repacks the codes (gptq_marlin_repack, CUDA), permutes the scales and turns them into
the kernel's S0E5M3 bytes, folding powers of two into the global scale; any N and any K a multiple of 16 are padded
to Marlin's tiles (weights once, activations and outputs on each call). The kernel multiplies code x scale in the
activations' dtype (exact: at most 7 significant bits), sums the products in fp32, multiplies the sums by the global
scale in fp32 and rounds once to the activations' dtype.

Two things Marlin cannot hold as they are:
  * One global scale per layer, where a fused layer read from a CloverLM checkpoint (qkv, gate / up) has one per
    part. vLLM's ModelOpt method takes the parts' largest and leaves the other parts' block scales as they are (it
    warns: those parts come out scaled wrongly). Rescaling the E4M3 block scales by the ratio instead re-rounds them
    (lossy unless the ratio is a power of two). We keep every code and block scale and run Marlin with one global
    scale g, a power of two >= the largest part's, then multiply each output column by its part's ratio (its tensor
    scale / g: exact, a division by a power of two) in fp32: the weights stay exact, the output is rounded twice
    (Marlin's, then the product's) instead of once. Layers quantized on the fly have one tensor scale: no ratio.
  * Marlin's S0E5M3 scale bytes hold E4M3's normal range only: a block scale below 2^-6 (an E4M3 subnormal, after
    the power-of-two lift vLLM applies when the layer's scales are small) is flushed to zero, and its group of 16
    weights with it. Such a group's weights are all below 6 * 2^-6 tensor-scale units (by the 4/6 rule, below 6.2e-5 of
    the tensor's largest magnitude): marlin_flushed_groups counts them, and the method logs the count.

By token count the path's op runs the few-token kernel (marlin_mma), Marlin, or the decoded weight with cuBLAS
(marlin_dequant); naive.w4a16_reference is the reference of all three.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ... import nvfp4
from ...nvfp4 import NVFP4Weight
from .. import marlin_dequant, marlin_layout, marlin_mma

DTYPES = (torch.bfloat16, torch.float16)
MMA_ENV = "TURBOQUANT_QUARTET2_MMA"
DENSE_ENV = "TURBOQUANT_QUARTET2_DENSE_MIN_TOKENS"  # tokens from which a GEMM decodes the weight for cuBLAS; 0: never


class VllmNVFP4(NamedTuple):
    """An NVFP4 weight as vLLM's NVFP4 methods hold it before prepare_fp4_layer_for_marlin (pre-Marlin layout)."""

    weight: torch.Tensor  # uint8 (N, K / 2), element 2i in the low nibble
    weight_scale: torch.Tensor  # float8_e4m3fn (N, K / 16), row-major
    weight_global_scale: torch.Tensor  # fp32 scalar, the multiplier
    channel_scale: torch.Tensor | None  # fp32 (N,): each output column's tensor scale / the global one; None: all 1


def to_vllm_nvfp4(w: NVFP4Weight) -> VllmNVFP4:
    """Our NVFP4 weight -> vLLM's pre-Marlin NVFP4 tensors: codes and block scales as they are; one tensor scale
    becomes the global scale; one per output row (fused parts with their own) becomes a power-of-two global scale
    and an exact per-column ratio (see the module's docstring)."""
    packed, scales, ts = w.packed, w.scales, w.tensor_scale.to(torch.float32)
    if packed.dtype != torch.uint8 or scales.dtype != torch.float8_e4m3fn or packed.dim() != 2:
        raise ValueError(f"NVFP4 weights are uint8 codes and float8_e4m3fn scales, got {packed.dtype}, {scales.dtype}")
    n, half = packed.shape
    if tuple(scales.shape) != (n, 2 * half // nvfp4.GROUP) or ts.numel() not in (1, n):
        raise ValueError(f"NVFP4 scales {tuple(scales.shape)} and tensor scale {tuple(ts.shape)} do not fit codes "
                         f"{tuple(packed.shape)}")
    if not (torch.isfinite(ts).all() and (ts > 0).all()):
        raise ValueError("NVFP4 tensor scales must be finite and positive")
    if ts.numel() == 1 or bool((ts == ts.reshape(-1)[0]).all()):
        return VllmNVFP4(packed.contiguous(), scales.contiguous(), ts.reshape(-1)[0].clone(), None)
    _, exponent = torch.frexp(ts.max())  # max = m 2^e, 0.5 <= m < 1: g = 2^e > max, exactly
    global_scale = torch.ldexp(torch.ones_like(ts.max()), exponent)
    return VllmNVFP4(packed.contiguous(), scales.contiguous(), global_scale, (ts / global_scale).contiguous())


def marlin_flushed_groups(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool (N, K / 16): the groups whose nonzero E4M3 scale Marlin's S0E5M3 bytes flush to zero for activations of
    `dtype`, by vLLM's rule (nvfp4_marlin_process_scales with the scale factor _nvfp4_compute_scale_factor picks:
    for bf16 the power of two lifting the largest scale closest to 448, none for fp16; then scale * factor * 2^7
    < 2 is dropped)."""
    s = scales.to(torch.float32)
    return (s > 0) & (s * scale_lift(scales, dtype) * 2**7 < 2)


def scale_lift(scales: torch.Tensor, dtype: torch.dtype) -> float:
    """The power of two vLLM lifts a layer's E4M3 block scales by for Marlin (_nvfp4_compute_scale_factor, on the same
    scales: 1 for fp16 activations)."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import _nvfp4_compute_scale_factor

    return _nvfp4_compute_scale_factor(scales.to(torch.half), dtype)


class MarlinNVFP4(NamedTuple):
    """An NVFP4 weight in Marlin's layout, ready for marlin_linear."""

    weight: torch.Tensor  # int32, repacked (padded) codes
    weight_scale: torch.Tensor  # float8_e4m3fn: the permuted S0E5M3 scale bytes
    weight_global_scale: torch.Tensor  # fp32 scalar, with Marlin's exponent offsets folded in
    channel_scale: torch.Tensor | None  # fp32 (N,), or None
    size_n: int
    size_k: int
    dtype: torch.dtype  # the activations' dtype the scales were prepared for
    dense_alpha: float  # the decoded weight's matmul scale (marlin_dequant): the tensor scale / vLLM's scale lift
    dense_min_tokens: int  # from this many tokens on, decode + cuBLAS instead of Marlin (0: never)
    mma_max_tokens: int = 0  # up to this many tokens, the native few-token kernel instead of Marlin (0: never)


def prepare(w: NVFP4Weight, dtype: torch.dtype) -> MarlinNVFP4:
    """NVFP4Weight -> Marlin's layout for activations of `dtype` (bf16 or fp16), through vLLM's own
    prepare_fp4_layer_for_marlin (on a stand-in module: the layer's own bias is left alone)."""
    from vllm.model_executor.layers.quantization.utils import marlin_utils_fp4

    if dtype not in DTYPES:
        raise ValueError(f"Marlin FP4 takes bf16 or fp16 activations, not {dtype}")
    v = to_vllm_nvfp4(w)
    stub = torch.nn.Module()
    stub.output_size_per_partition, stub.input_size_per_partition = v.weight.shape[0], 2 * v.weight.shape[1]
    stub.params_dtype = dtype
    # vLLM's replace_parameter copies a result into the parameter it replaces where shape and dtype agree (the global
    # scale, and scales of some shapes): the stub's scales are copies, so w's and v's stay as they are. The codes
    # change dtype (int32), so theirs is rebound, never written into.
    stub.weight = torch.nn.Parameter(v.weight, requires_grad=False)
    for name in ("weight_scale", "weight_global_scale"):
        setattr(stub, name, torch.nn.Parameter(getattr(v, name).clone(), requires_grad=False))
    stub.bias = None
    marlin_utils_fp4.prepare_fp4_layer_for_marlin(stub)
    lift = scale_lift(v.weight_scale, dtype)
    n, k = stub.output_size_per_partition, stub.input_size_per_partition
    dense_min_tokens = dense_threshold()
    if dense_min_tokens:
        marlin_dequant.reserve_scratch(n * k, v.weight.device, dtype)
        if v.weight.is_cuda:  # at load: vLLM's layout probed and checked against the decoder's (tile_layout)
            marlin_layout.tables(v.weight.device, dtype)
    mma_max_tokens = marlin_mma.POLICY_TOKENS if mma_enabled() and marlin_mma.supported(v.weight.device) is None else 0
    if mma_max_tokens:
        marlin_mma.reserve_workspace(stub.weight_scale.shape[1], k, v.weight.device)
        marlin_mma.zero_flushed_codes(stub.weight.data, stub.weight_scale.data)  # Marlin reads those as zeros anyway
    _register_op()
    return MarlinNVFP4(stub.weight.data, stub.weight_scale.data, stub.weight_global_scale.data, v.channel_scale, n, k,
                       dtype, float(v.weight_global_scale) / lift, dense_min_tokens, mma_max_tokens)


def mma_enabled() -> bool:
    """MMA_ENV (default 1): 0 keeps Marlin for few tokens even where the native kernel is built."""
    value = os.environ.get(MMA_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{MMA_ENV}={value!r}: give 1 (the native few-token kernel where built) or 0 (Marlin)")
    return value == "1"


def dense_threshold() -> int:
    """Tokens from which the marlin path's GEMMs decode the weight and call cuBLAS (DENSE_ENV, default
    marlin_dequant.DENSE_MIN_TOKENS; 0 turns it off)."""
    value = os.environ.get(DENSE_ENV, str(marlin_dequant.DENSE_MIN_TOKENS)).strip()
    if not value.isdigit():
        raise ValueError(f"{DENSE_ENV}={value!r}: give a token count (0: always Marlin)")
    return int(value)


def marlin_linear(x: torch.Tensor, m: MarlinNVFP4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias), W the exact NVFP4 weight, x (..., K) in m.dtype unquantized: W4A16; y in x's dtype. The
    bias is added outside the kernel (Marlin would want it permuted, and after the per-column ratio). From
    m.dense_min_tokens tokens on, the weight is decoded for cuBLAS instead (marlin_dequant)."""
    if x.dtype != m.dtype:
        raise ValueError(f"this Marlin NVFP4 weight was prepared for {m.dtype} activations, got {x.dtype}")
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.ops.turboquant_vllm.quartet2_marlin_gemm(x2, m.weight, m.weight_scale, m.weight_global_scale,
                                                        m.size_n, m.size_k, m.dense_alpha,
                                                        m.dense_min_tokens, m.mma_max_tokens
                                                        ).reshape(*x.shape[:-1], m.size_n)
    if m.channel_scale is not None:
        y32 = y.to(torch.float32) * m.channel_scale
        return (y32 if bias is None else y32 + bias.to(torch.float32)).to(x.dtype)
    return y if bias is None else y + bias


def _marlin_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, global_scale: torch.Tensor,
                 size_n: int, size_k: int, dense_alpha: float,
                 dense_min_tokens: int, mma_max_tokens: int) -> torch.Tensor:
    """x (M, K) -> (M, N): up to mma_max_tokens tokens the native few-token kernel, from dense_min_tokens on the
    weight decoded for one cuBLAS call, Marlin between. A custom op, so that torch.compile leaves the choice to each
    call's token count instead of tracing one branch."""
    from vllm.model_executor.layers.quantization.utils import marlin_utils_fp4

    if 0 < x.shape[0] <= mma_max_tokens:
        return marlin_mma.gemm(x, weight, weight_scale, size_n, size_k, dense_alpha)
    if dense_min_tokens and x.shape[0] >= dense_min_tokens:
        return marlin_dequant.dense_linear(x, weight, weight_scale, size_n, size_k, dense_alpha)
    return marlin_utils_fp4.apply_fp4_marlin_linear(input=x, weight=weight, weight_scale=weight_scale,
                                                    weight_global_scale=global_scale, workspace=None,
                                                    size_n=size_n, size_k=size_k)  # None: vLLM's shared locks


def _marlin_gemm_fake(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, global_scale: torch.Tensor,
                      size_n: int, size_k: int, dense_alpha: float,
                      dense_min_tokens: int, mma_max_tokens: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], size_n))


def _register_op() -> None:
    """torch.ops.turboquant_vllm.quartet2_marlin_gemm, once per process."""
    if hasattr(torch.ops.turboquant_vllm, "quartet2_marlin_gemm"):
        return
    from torch.library import Library
    from vllm.utils.torch_utils import direct_register_custom_op

    global _LIB
    _LIB = Library("turboquant_vllm", "FRAGMENT")  # lives as long as the op
    direct_register_custom_op("quartet2_marlin_gemm", _marlin_gemm, mutates_args=[], fake_impl=_marlin_gemm_fake,
                              target_lib=_LIB, dispatch_key="CompositeExplicitAutograd")  # tests run it on CPU


_LIB = None
