"""The `awq_turbomind` method's TurboMind side (its config and registration: config.py; what it runs: support.py): the
turbomind wheel loaded and checked, AWQ weights created and loaded as vLLM's AWQ method does, repacked once into
TurboMind's layout, and run through one torch custom op (registered when this module is imported, before any model is
built or compiled) with a fake implementation, so torch.compile and full CUDA graphs see an ordinary op.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import weakref
from typing import Any

import torch
from torch.library import Library
from vllm.model_executor.layers.linear import LinearMethodBase, register_weight_loader_v2_supported_method
from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter
from vllm.platforms import current_platform
from vllm.utils.torch_utils import direct_register_custom_op

from .awq_format import BITS, PACK
from .support import INSTALL, MIN_CAPABILITY, NAME, WAY_OUT

logger = logging.getLogger("vllm.turboquant_vllm.awq_turbomind")


def preload_cuda12_runtime() -> None:
    """turbomind's extension links libcudart.so.12 with no search path of its own: a torch built for CUDA 12 has
    loaded it already; otherwise load the copy of the nvidia-cuda-runtime-cu12 wheel (the extra installs it)."""
    try:
        ctypes.CDLL("libcudart.so.12", mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
        return  # already in the process
    except OSError:
        pass
    spec = importlib.util.find_spec("nvidia.cuda_runtime") if importlib.util.find_spec("nvidia") else None
    for base in (spec.submodule_search_locations or []) if spec else []:
        lib = os.path.join(base, "lib", "libcudart.so.12")
        if os.path.exists(lib):
            try:
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                pass  # the import below then fails, and load_turbomind says what to install
            return


def load_turbomind():
    """The turbomind module with its CUDA extension loaded; ImportError naming the install line otherwise."""
    if "turbomind" not in sys.modules:
        preload_cuda12_runtime()
    try:
        turbomind = importlib.import_module("turbomind")
    except Exception as exc:  # ImportError, or OSError from a shared library it links (libcudart.so.12)
        raise ImportError(f"{NAME} needs TurboMind's kernels (the turbomind 0.0.2 wheel), which do not import here: "
                          f"{type(exc).__name__}: {exc}. Install them with {INSTALL}, or serve the checkpoint with "
                          f"vLLM's own AWQ kernels (without -q {NAME}).") from exc
    # turbomind 0.0.2 catches its extension's ImportError, logs it and fails only at the first Linear(): ask first
    linear = sys.modules.get("turbomind.linear")
    if linear is not None and not getattr(linear, "TURBOMIND_EXTENSION_INSTALLED", True):
        raise ImportError(f"{NAME}: turbomind is installed but its CUDA extension (_turbomind_ext) did not load (its "
                          f"error is logged above; it needs the CUDA 12 runtime, libcudart.so.12). Reinstall with "
                          f"{INSTALL}, or serve the checkpoint with vLLM's own AWQ kernels (without -q {NAME}).")
    if not _exit_hook:  # its static workspaces would be freed after the CUDA runtime (an abort at exit)
        atexit.register(turbomind.Linear.clear_workspaces)
        _exit_hook.append(True)
    return turbomind


_exit_hook: list[bool] = []


def turbomind_version() -> str:
    try:
        return importlib.metadata.version("turbomind")
    except importlib.metadata.PackageNotFoundError:
        return "(not an installed distribution)"


def check_platform() -> None:
    """TurboMind's kernels are CUDA, sm70 and newer: a clear refusal elsewhere (before vLLM's generic one)."""
    if current_platform.is_rocm():
        raise ValueError(f"{NAME}: TurboMind's int4 kernels are CUDA kernels for NVIDIA GPUs; this is ROCm. "
                         f"{WAY_OUT}.")
    capability = current_platform.get_device_capability()  # NVML: no CUDA context in this process
    if capability is not None and capability.to_int() < MIN_CAPABILITY:
        raise ValueError(f"{NAME}: TurboMind's int4 kernels need compute capability 7.0 (Volta) or newer; this GPU "
                         f"is {capability.major}.{capability.minor}. Use a newer GPU, or serve the checkpoint "
                         f"without -q {NAME}.")


@register_weight_loader_v2_supported_method  # its parameters are vLLM's: the fused / sharded loaders fill them
class AWQTurboMindLinearMethod(LinearMethodBase):
    """AWQ tensors created and loaded as vLLM's AWQ method does; then one TurboMind Linear per layer."""

    def __init__(self, group_size: int, weight_bits: int = BITS) -> None:
        self.group_size = group_size  # the checkpoint's, checked by the config (support.refusal)
        self.weight_bits = weight_bits

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        group = self.group_size
        if input_size_per_partition % group:
            raise ValueError(f"{NAME}: AWQ groups {group} input features; this layer has {input_size_per_partition} "
                             f"per tensor-parallel rank ({input_size} in all). Use a tensor-parallel size that keeps "
                             f"it a multiple of {group}, or serve without -q {NAME}.")
        if any(n % PACK for n in output_partition_sizes):
            raise ValueError(f"{NAME}: AWQ packs {PACK} output features a word; this layer's outputs per "
                             f"tensor-parallel rank are {output_partition_sizes}. Use a tensor-parallel size that "
                             f"keeps each a multiple of {PACK}, or serve without -q {NAME}.")
        weight_loader = extra_weight_attrs.get("weight_loader")
        n_words = sum(output_partition_sizes) // PACK
        groups = input_size_per_partition // group
        packed = dict(input_dim=0, output_dim=1, packed_dim=1, packed_factor=PACK, weight_loader=weight_loader)
        layer.register_parameter("qweight", PackedvLLMParameter(
            data=torch.empty(input_size_per_partition, n_words, dtype=torch.int32), **packed))
        layer.register_parameter("qzeros", PackedvLLMParameter(
            data=torch.empty(groups, n_words, dtype=torch.int32), **packed))
        # fp16 whatever the model's dtype: the checkpoint's fp16 scales stay exact, and TurboMind reads fp16
        layer.register_parameter("scales", GroupQuantScaleParameter(
            data=torch.empty(groups, sum(output_partition_sizes), dtype=torch.float16), input_dim=0, output_dim=1,
            weight_loader=weight_loader))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        turbomind = load_turbomind()
        qweight = layer.qweight.data
        k, n = qweight.shape[0], qweight.shape[1] * PACK
        linear = turbomind.Linear(k, n, bias=False, quant_method="awq", w_bit=self.weight_bits,
                                  group_size=self.group_size, device=qweight.device)
        linear.qweight.copy_(qweight)
        linear.qzeros.copy_(layer.qzeros.data)
        linear.scales.copy_(layer.scales.data)
        linear.post_init()  # AWQ nibble order -> TurboMind's; the C++ side converts and fuses scales / zeros
        if qweight.is_cuda and qweight.device not in _STREAMS:  # the stream's workspace, made outside any capture
            run_kernel(linear, torch.zeros(1, k, dtype=torch.float16, device=qweight.device))
        del layer.qweight, layer.qzeros, layer.scales  # the checkpoint's tensors go: TurboMind's copy is the weight
        # linear.qweight (and the scales / zeros it keeps) stay alive with `linear`: the C++ object reads them
        layer.register_buffer("tm_qweight", linear.qweight, persistent=False)
        key = linear.qweight.data_ptr()
        _LINEARS[key] = linear
        weakref.finalize(layer, _LINEARS.pop, key, None)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n = layer.tm_qweight.shape[1] * PACK
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != torch.float16:
            x2 = x2.to(torch.float16)  # TurboMind's kernels are fp16 only (bf16 values beyond 65504 become inf)
        out = torch.ops.turboquant_vllm.awq_turbomind_gemm(x2.contiguous(), layer.tm_qweight)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        if bias is not None:
            out.add_(bias)
        return out.reshape(*x.shape[:-1], n)


# Each layer's TurboMind state (its C++ object: the converted weight, the fused scales / zeros, kernel dispatch) cannot
# pass through an op's schema. The op takes the layer's TurboMind-layout qweight, which that object reads, and finds
# the object by the tensor's address: the schema stays tensors only, and no per-process number is baked into the
# graph, which vLLM 0.33 caches and loads in later processes (VLLM_USE_AOT_COMPILE, on by default): an integer
# handle counted at loading would there pick another layer if the count differed. A copied weight fails loudly.
_LINEARS: dict[int, Any] = {}


# TurboMind 0.0.2 makes its split-k workspace lazily, one per (device, stream), with cudaMallocAsync: made inside a
# CUDA graph capture (vLLM captures on streams of its own), it is recorded in that one graph, and the graphs captured
# after it reuse its address, unmapped outside it (an illegal address at replay). Every TurboMind GEMM therefore runs
# on one stream per device, forked from the current stream and joined back (both captured as graph edges), whose
# workspace the first layer's loading makes eagerly.
_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def kernel_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def run_kernel(linear: Any, x: torch.Tensor) -> torch.Tensor:
    """The one call into TurboMind: x (M, K) fp16, contiguous -> (M, N) fp16, ordered on the current stream."""
    if x.device.type != "cuda":
        return linear.forward(x)  # a stand-in Linear (the CPU tests' fake)
    out = torch.empty((x.shape[0], linear.out_features), dtype=torch.float16, device=x.device)
    current, stream = torch.cuda.current_stream(x.device), kernel_stream(x.device)
    stream.wait_stream(current)
    linear.linear.forward(x, out, stream.cuda_stream)  # the C++ Linear: turbomind.Linear.forward without its copies
    current.wait_stream(stream)
    return out


def _awq_turbomind_gemm(x: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    linear = _LINEARS.get(qweight.data_ptr())
    if linear is None:
        raise RuntimeError(f"{NAME}: no TurboMind layer holds this weight (tm_qweight was copied or moved after "
                           f"loading; TurboMind's C++ object reads it in place)")
    if x.shape[0] == 0:
        return x.new_empty((0, qweight.shape[1] * PACK), dtype=torch.float16)
    return run_kernel(linear, x)


def _awq_turbomind_gemm_fake(x: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], qweight.shape[1] * PACK), dtype=torch.float16)


_LIB = Library("turboquant_vllm", "FRAGMENT")  # lives as long as the op


def _register_op() -> None:
    """torch.ops.turboquant_vllm.awq_turbomind_gemm(x fp16 (M, K), qweight int32 (K, N/8)) -> fp16 (M, N), once per
    process (vLLM's direct registration: less dispatch overhead per call than torch.library.custom_op)."""
    if hasattr(torch.ops.turboquant_vllm, "awq_turbomind_gemm"):
        return
    direct_register_custom_op("awq_turbomind_gemm", _awq_turbomind_gemm, mutates_args=[],
                              fake_impl=_awq_turbomind_gemm_fake, target_lib=_LIB,
                              dispatch_key="CompositeExplicitAutograd")  # any device: tests run it on CPU fakes


_register_op()
