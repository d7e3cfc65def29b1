"""The vLLM method `awq_turbomind` (quant.awq_turbomind: config, support, method) on the CPU, with a fake `turbomind`
module: turbomind 0.0.2's Linear (constructor, buffers, post_init, forward) in plain PyTorch, its post_init repacking
AWQ's tensors into TurboMind's layout as the wheel's does and its forward computing from that layout. Checked: the
config's parsing and refusals, which checkpoints it claims, the missing-wheel error and the CUDA 12 runtime's preload,
and vLLM's fused / parallel layers loaded by vLLM's loaders and applied through the custom op, against an fp32
dequantize-then-matmul of the checkpoint's tensors."""

import sys
import types

import pytest
import torch

from turboquant_vllm.quant.awq_turbomind import awq_format, method, support
from turboquant_vllm.quant.awq_turbomind.config import AWQTurboMindConfig

GROUP = 128
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}


def _pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """(R, N) codes -> (R, N / 8) int32, column 8j + i at bits 4i (TurboMind's order, after the wheel's repack)."""
    r, n = codes.shape
    words = (codes.to(torch.int64).view(r, n // 8, 8) << torch.arange(0, 32, 4)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _unpack_rows(words: torch.Tensor) -> torch.Tensor:
    return ((words.unsqueeze(-1) >> torch.arange(0, 32, 4, dtype=torch.int32)) & 15).flatten(-2)


class FakeLinear(torch.nn.Module):
    """turbomind 0.0.2's `turbomind.Linear`, same signature and checks, the C++ kernel replaced by PyTorch."""

    forward_calls = 0

    def __init__(self, in_features, out_features, bias=False, quant_method="", w_bit=4, group_size=128,
                 device="cuda"):
        super().__init__()
        if w_bit not in [4]:
            raise NotImplementedError(f"Only 4-bit is supported for now, but got {w_bit} bit")
        if group_size != 128:
            raise NotImplementedError(f"Only group_size 128 is supported for now, but got group_size {group_size}")
        if bias:
            raise NotImplementedError("bias has not been supported yet")
        assert in_features % group_size == 0 and out_features % 8 == 0
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.quant_method = quant_method
        self.register_buffer("qweight", torch.zeros(in_features, out_features // 8, dtype=torch.int32, device=device))
        self.register_buffer("qzeros", torch.zeros(in_features // group_size, out_features // 8, dtype=torch.int32,
                                                   device=device))
        self.register_buffer("scales", torch.zeros(in_features // group_size, out_features, dtype=torch.float16,
                                                   device=device))
        self.bias = None
        self.initialized = False

    def post_init(self):
        assert self.quant_method == "awq"
        # the wheel: unpack_awq_gemm (AWQ's nibble order undone), pack_u4_row, zeros to fp16
        self.qweight = _pack_rows(awq_format.unpack(self.qweight)).contiguous()
        self.qzeros = awq_format.unpack(self.qzeros).to(torch.half).contiguous()
        self.scales = self.scales.contiguous()
        self.initialized = True

    @torch.no_grad()
    def forward(self, x):
        assert self.initialized, "forward before post_init"
        assert x.dtype == torch.float16 and x.dim() == 2 and x.is_contiguous(), (x.dtype, x.shape)
        FakeLinear.forward_calls += 1
        g = self.group_size
        w = (_unpack_rows(self.qweight).float() - self.qzeros.float().repeat_interleave(g, 0)) \
            * self.scales.float().repeat_interleave(g, 0)
        return (x.float() @ w).half()

    @classmethod
    def clear_workspaces(cls):
        return None


@pytest.fixture
def fake_turbomind(monkeypatch):
    module = types.ModuleType("turbomind")
    module.Linear = FakeLinear
    monkeypatch.setitem(sys.modules, "turbomind", module)
    monkeypatch.delitem(sys.modules, "turbomind.linear", raising=False)
    return module


@pytest.fixture
def no_turbomind(monkeypatch):
    monkeypatch.setitem(sys.modules, "turbomind", None)  # `import turbomind` raises ImportError


def test_the_config_reads_autoawq_configs(fake_turbomind):
    config = AWQTurboMindConfig.from_config(dict(AWQ_CONFIG, modules_to_not_convert=["visual"]))
    assert (config.get_name(), config.weight_bits, config.group_size, config.zero_point) == ("awq_turbomind", 4,
                                                                                             128, True)
    assert config.modules_to_not_convert == ["visual"]
    # AutoAWQ's quant_config.json: other key names, version in capitals, no quant_method
    old = AWQTurboMindConfig.from_config({"zero_point": True, "q_group_size": 128, "w_bit": 4,
                                                 "version": "GEMM"})
    assert (old.weight_bits, old.group_size, old.modules_to_not_convert) == (4, 128, [])
    assert AWQTurboMindConfig.get_min_capability() == 70
    assert AWQTurboMindConfig.get_config_filenames() == ["quant_config.json", "quantize_config.json"]
    assert config.get_supported_act_dtypes() == [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("change, message", [
    ({"bits": 8}, "runs 4-bit AWQ only .* bits=8"),
    ({"group_size": 64}, "group size 128 only; this checkpoint has group_size=64"),
    ({"group_size": -1}, "group_size=-1"),
    ({"version": "gemv"}, "GEMM format .* version 'gemv'"),
    ({"zero_point": False}, "zero points .* symmetric"),
    ({"lm_head": True}, "quantizes lm_head"),
    ({"quant_method": "gptq"}, "quantized with gptq"),
])
def test_what_turbomind_cannot_run_is_refused_with_the_way_out(fake_turbomind, change, message):
    with pytest.raises(ValueError, match=message) as info:
        AWQTurboMindConfig.from_config(dict(AWQ_CONFIG, **change))
    assert "without -q awq_turbomind" in str(info.value)


def test_a_gpu_below_sm70_and_rocm_are_refused(fake_turbomind, monkeypatch):
    from vllm.platforms.interface import DeviceCapability

    platform = types.SimpleNamespace(is_rocm=lambda: False, get_device_capability=lambda: DeviceCapability(6, 1))
    monkeypatch.setattr(method, "current_platform", platform)
    with pytest.raises(ValueError, match="compute capability 7.0 .* this GPU is 6.1"):
        AWQTurboMindConfig.from_config(AWQ_CONFIG)
    platform.get_device_capability = lambda: DeviceCapability(7, 0)
    AWQTurboMindConfig.from_config(AWQ_CONFIG)
    platform.is_rocm = lambda: True
    with pytest.raises(ValueError, match="CUDA kernels .* this is ROCm"):
        AWQTurboMindConfig.from_config(AWQ_CONFIG)


def test_a_missing_turbomind_names_the_install_line(no_turbomind):
    with pytest.raises(ImportError, match=r'Install them with pip install "\.\[turbomind\]" \(run from the '
                                          r'turboquant-vllm source tree\)'):
        AWQTurboMindConfig.from_config(AWQ_CONFIG)


def test_the_cuda12_runtime_is_preloaded_from_the_wheel_only_where_missing(monkeypatch, tmp_path):
    """libcudart.so.12 already in the process: nothing else is looked up. Missing: the nvidia-cuda-runtime-cu12
    wheel's copy is loaded globally (turbomind's extension then links it); a broken copy is left for the import to
    report; no wheel: nothing is loaded."""
    import ctypes
    import os

    loads = []
    loaded = {"libcudart.so.12": False}

    def cdll(name, mode=0):
        loads.append((name, mode))
        if mode & os.RTLD_NOLOAD and not loaded[name]:
            raise OSError(f"{name}: not loaded")
        if name != "libcudart.so.12":
            raise OSError(f"{name}: invalid ELF header")
        return object()

    looked_up = []
    (tmp_path / "lib").mkdir()
    wheel_copy = tmp_path / "lib" / "libcudart.so.12"
    wheel_copy.write_bytes(b"not a library")
    spec = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(method.ctypes, "CDLL", cdll)
    monkeypatch.setattr(method.importlib.util, "find_spec", lambda name: looked_up.append(name) or spec)

    loaded["libcudart.so.12"] = True
    method.preload_cuda12_runtime()
    assert loads == [("libcudart.so.12", os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)] and looked_up == []

    loads.clear()
    loaded["libcudart.so.12"] = False
    method.preload_cuda12_runtime()  # the copy fails to load: no exception here
    assert looked_up == ["nvidia", "nvidia.cuda_runtime"]
    assert loads[1:] == [(str(wheel_copy), ctypes.RTLD_GLOBAL)]

    loads.clear()
    monkeypatch.setattr(method.importlib.util, "find_spec", lambda name: None)  # no nvidia wheels installed
    method.preload_cuda12_runtime()
    assert [name for name, _ in loads] == ["libcudart.so.12"]


def test_a_turbomind_whose_extension_did_not_load_is_refused(fake_turbomind, monkeypatch):
    # turbomind 0.0.2 logs its extension's ImportError and sets this flag instead of raising
    monkeypatch.setitem(sys.modules, "turbomind.linear",
                        types.SimpleNamespace(TURBOMIND_EXTENSION_INSTALLED=False))
    with pytest.raises(ImportError, match=r"_turbomind_ext.*did not load.*libcudart\.so\.12"):
        AWQTurboMindConfig.from_config(AWQ_CONFIG)


def test_register_needs_no_turbomind_and_is_idempotent(no_turbomind):
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from turboquant_vllm.quant import awq_turbomind

    awq_turbomind.register()
    awq_turbomind.register()
    assert QUANTIZATION_METHODS.count("awq_turbomind") == 1
    assert get_quantization_config("awq_turbomind") is AWQTurboMindConfig
    assert sys.modules["turbomind"] is None  # nothing tried to import it


def test_awq_checkpoints_are_claimed_only_when_asked(monkeypatch):
    claim = AWQTurboMindConfig.override_quantization_method
    monkeypatch.delenv(support.OPT_IN_ENV, raising=False)
    assert claim(AWQ_CONFIG, None) is None  # vLLM's own AWQ keeps serving AWQ models
    assert claim(AWQ_CONFIG, "awq") is None
    assert claim(AWQ_CONFIG, "awq_turbomind", hf_config=None) == "awq_turbomind"
    assert claim(dict(AWQ_CONFIG, version="GEMM"), "awq_turbomind") == "awq_turbomind"
    # asked for explicitly, an AWQ GEMM checkpoint it cannot run is claimed: from_config then says why
    assert claim(dict(AWQ_CONFIG, group_size=64), "awq_turbomind") == "awq_turbomind"
    for other in ({"quant_method": "gptq", "bits": 4, "group_size": 128}, {"quant_method": "fp8"},
                  dict(AWQ_CONFIG, version="gemv"), dict(AWQ_CONFIG, version="gemv_fast")):
        assert claim(other, "awq_turbomind") is None
        assert claim(other, None) is None

    monkeypatch.setenv(support.OPT_IN_ENV, "1")
    assert claim(AWQ_CONFIG, None) == "awq_turbomind"
    assert claim(AWQ_CONFIG, "awq") is None  # the user's explicit choice wins over the opt-in
    assert claim(AWQ_CONFIG, "awq_marlin") is None
    assert claim(dict(AWQ_CONFIG, group_size=64), None) is None  # opted in: only what TurboMind runs
    assert claim(dict(AWQ_CONFIG, bits=8), None) is None
    assert claim(dict(AWQ_CONFIG, version="gemv"), None) is None
    assert claim({"quant_method": "gptq", "bits": 4, "group_size": 128}, None) is None
    monkeypatch.setenv(support.OPT_IN_ENV, "0")
    assert claim(AWQ_CONFIG, None) is None


def test_vllm_resolves_the_method_through_the_override(monkeypatch):
    """vLLM 0.33's ModelConfig._verify_quantization, on an AWQ checkpoint: custom methods are asked first."""
    from vllm.config import ModelConfig

    from turboquant_vllm.quant import awq_turbomind

    awq_turbomind.register()
    monkeypatch.delenv(support.OPT_IN_ENV, raising=False)

    def resolve(user_quant):
        cfg = object.__new__(ModelConfig)
        cfg.quantization = user_quant
        cfg.model_arch_config = types.SimpleNamespace(quantization_config=dict(AWQ_CONFIG))
        cfg.hf_config = None
        monkeypatch.setattr("vllm.config.model.current_platform.verify_quantization", lambda q: None)
        cfg._verify_quantization()
        return cfg.quantization

    assert resolve("awq_turbomind") == "awq_turbomind"
    assert resolve(None) != "awq_turbomind"
    monkeypatch.setenv(support.OPT_IN_ENV, "1")
    assert resolve(None) == "awq_turbomind"


def test_modules_to_not_convert_stay_16_bit(fake_turbomind, one_rank):
    from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod

    config = AWQTurboMindConfig.from_config(dict(AWQ_CONFIG, modules_to_not_convert=["visual", "mlp.gate"]))
    linear = object.__new__(ReplicatedLinear)
    assert isinstance(config.get_quant_method(linear, "visual.blocks.0.attn.qkv"), UnquantizedLinearMethod)
    assert isinstance(config.get_quant_method(linear, "model.layers.3.mlp.gate"), UnquantizedLinearMethod)
    assert isinstance(config.get_quant_method(linear, "model.layers.3.mlp.down_proj"),
                      method.AWQTurboMindLinearMethod)
    assert config.get_quant_method(torch.nn.Embedding(4, 4), "model.embed_tokens") is None
    # a skipped layer is an ordinary vLLM layer: a 16-bit weight, no AWQ tensors
    layer = ReplicatedLinear(256, 64, bias=False, params_dtype=torch.float16, quant_config=config,
                             prefix="visual.proj")
    assert layer.weight.shape == (64, 256) and not hasattr(layer, "qweight")


def test_unlisted_16_bit_modules_are_found_and_moe_is_refused(fake_turbomind, monkeypatch):
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.transformers_utils import config as hf_utils

    metadata = {"model.layers.0.self_attn.q_proj.qweight": {"dtype": "I32"},
                "model.layers.0.self_attn.q_proj.scales": {"dtype": "F16"},
                "model.layers.0.mlp.gate.weight": {"dtype": "BF16"}}
    monkeypatch.setattr(hf_utils, "get_safetensors_params_metadata", lambda model, revision=None: metadata)
    config = AWQTurboMindConfig.from_config(AWQ_CONFIG)
    config.maybe_update_config("some/model")
    assert config.modules_to_not_convert == ["model.layers.0.mlp.gate"]
    with pytest.raises(ValueError, match="mixture-of-experts .* without -q awq_turbomind"):
        config.get_quant_method(object.__new__(RoutedExperts), "model.layers.0.mlp.experts")


def test_layers_refuse_partitions_the_groups_do_not_divide(fake_turbomind, one_rank):
    quant = method.AWQTurboMindLinearMethod(GROUP)
    with pytest.raises(ValueError, match="groups 128 input features; this layer has 192 per tensor-parallel rank"):
        quant.create_weights(torch.nn.Module(), 192, [256], 384, 256, torch.float16, weight_loader=None)
    with pytest.raises(ValueError, match="packs 8 output features"):
        quant.create_weights(torch.nn.Module(), 256, [256, 12], 256, 268, torch.float16, weight_loader=None)


def _awq(k: int, n: int, gen: torch.Generator) -> awq_format.AWQWeight:
    return awq_format.quantize(torch.randn(k, n, generator=gen) * 0.05, GROUP)


def _check(layer, parts, bias, dtype, gen, k):
    """layer(x) for fresh x of odd token counts and leading dims vs x @ dequantize(parts side by side) + bias."""
    w = torch.cat([awq_format.dequantize(p) for p in parts], dim=1)
    calls = FakeLinear.forward_calls
    for shape in ((1, k), (7, k), (3, 5, k)):
        x = torch.randn(*shape, generator=gen).to(dtype)
        out = layer(x)
        out = out[0] if isinstance(out, tuple) else out
        assert out.dtype == dtype and out.shape == (*shape[:-1], w.shape[1])
        want = x.float() @ w + (bias.float() if bias is not None else 0)
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=1e-2 * want.abs().max().item())
        assert ((out.float() - want).norm() / want.norm()).item() < 1e-2
    assert FakeLinear.forward_calls == calls + 3  # every call went through the kernel


def _assert_awq_tensors_freed(layer):
    names = dict(layer.named_parameters())
    assert not any(name in names for name in ("qweight", "qzeros", "scales"))
    assert not hasattr(layer, "qweight") and not hasattr(layer, "scales") and not hasattr(layer, "qzeros")
    assert layer.tm_qweight.dtype == torch.int32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_qkv_loads_through_vllm_and_matches_the_reference(fake_turbomind, one_rank, dtype):
    from vllm.model_executor.layers.linear import QKVParallelLinear

    gen = torch.Generator().manual_seed(0)
    config = AWQTurboMindConfig.from_config(AWQ_CONFIG)
    hidden, head, heads, kv_heads = 256, 64, 4, 2
    layer = QKVParallelLinear(hidden, head, heads, kv_heads, bias=True, params_dtype=dtype, quant_config=config,
                              prefix="model.layers.0.self_attn.qkv_proj")
    assert isinstance(layer.quant_method, method.AWQTurboMindLinearMethod)
    assert layer.scales.dtype == torch.float16  # exact fp16 scales whatever the model's dtype
    parts = {"q": _awq(hidden, heads * head, gen), "k": _awq(hidden, kv_heads * head, gen),
             "v": _awq(hidden, kv_heads * head, gen)}
    biases = {s: torch.randn(p.scales.shape[1], generator=gen).to(dtype) for s, p in parts.items()}
    for shard, p in parts.items():  # as a checkpoint of separate q / k / v projections is loaded
        for name in ("qweight", "qzeros", "scales"):
            param = getattr(layer, name)
            param.weight_loader(param, getattr(p, name), shard)
        layer.bias.weight_loader(layer.bias, biases[shard], shard)
    layer.quant_method.process_weights_after_loading(layer)
    _assert_awq_tensors_freed(layer)
    _check(layer, list(parts.values()), torch.cat(list(biases.values())), dtype, gen, hidden)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_merged_gate_up_and_row_parallel_down_match_the_reference(fake_turbomind, one_rank, dtype):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    gen = torch.Generator().manual_seed(1)
    config = AWQTurboMindConfig.from_config(AWQ_CONFIG)
    hidden, inter = 256, 384
    gate_up = MergedColumnParallelLinear(hidden, [inter, inter], bias=False, params_dtype=dtype,
                                         quant_config=config, prefix="model.layers.0.mlp.gate_up_proj")
    down = RowParallelLinear(inter, hidden, bias=False, params_dtype=dtype, quant_config=config,
                             prefix="model.layers.0.mlp.down_proj")
    gate, up, w_down = _awq(hidden, inter, gen), _awq(hidden, inter, gen), _awq(inter, hidden, gen)
    for shard, p in enumerate((gate, up)):
        for name in ("qweight", "qzeros", "scales"):
            param = getattr(gate_up, name)
            param.weight_loader(param, getattr(p, name), shard)
    for name in ("qweight", "qzeros", "scales"):
        param = getattr(down, name)
        param.weight_loader(param, getattr(w_down, name))
    for layer in (gate_up, down):
        layer.quant_method.process_weights_after_loading(layer)
        _assert_awq_tensors_freed(layer)
    _check(gate_up, [gate, up], None, dtype, gen, hidden)
    _check(down, [w_down], None, dtype, gen, inter)


def _loaded_layer(gen, k=256, n=192):
    config = AWQTurboMindConfig.from_config(AWQ_CONFIG)
    quant = config.get_quant_method(object.__new__(__import__("vllm.model_executor.layers.linear",
                                                              fromlist=["ReplicatedLinear"]).ReplicatedLinear), "x")
    layer = torch.nn.Module()
    quant.create_weights(layer, k, [n], k, n, torch.float16, weight_loader=None)
    w = _awq(k, n, gen)
    for name in ("qweight", "qzeros", "scales"):
        getattr(layer, name).data.copy_(getattr(w, name))
    quant.process_weights_after_loading(layer)
    return quant, layer, w


def test_the_custom_op_has_a_working_fake_and_compiles(fake_turbomind, one_rank):
    """Its fake gives the output's shape and dtype without running anything, and torch.compile traces apply with the
    op inside one graph (aot_eager: functionalization and the fake at symbolic token counts), equal to eager."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    gen = torch.Generator().manual_seed(2)
    quant, layer, w = _loaded_layer(gen)
    op = torch.ops.turboquant_vllm.awq_turbomind_gemm
    # (not torch.library.opcheck: it runs the op on copies of its inputs, and the op finds its layer by the weight's
    # address, see method._LINEARS; only an op called with the layer's own tm_qweight runs)
    with FakeTensorMode():
        out = op(torch.empty(9, 256, dtype=torch.float16), torch.empty(256, 24, dtype=torch.int32))
    assert out.shape == (9, 192) and out.dtype == torch.float16
    assert op(torch.empty(0, 256, dtype=torch.float16), layer.tm_qweight).shape == (0, 192)
    from torch._dynamo.backends.debugging import aot_eager

    traced = []

    def backend(gm, example_inputs):
        traced.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return aot_eager(gm, example_inputs)

    compiled = torch.compile(lambda t: quant.apply(layer, t), fullgraph=True, backend=backend, dynamic=True)
    for m in (3, 11):
        xb = torch.randn(m, 256, generator=gen).to(torch.bfloat16)
        torch.testing.assert_close(compiled(xb), quant.apply(layer, xb), rtol=0, atol=0)
    assert any("awq_turbomind_gemm" in target for target in traced)


def test_the_op_refuses_a_weight_no_layer_holds(fake_turbomind, one_rank):
    quant, layer, _ = _loaded_layer(torch.Generator().manual_seed(3))
    with pytest.raises(RuntimeError, match="no TurboMind layer holds this weight"):
        torch.ops.turboquant_vllm.awq_turbomind_gemm(torch.zeros(2, 256, dtype=torch.float16),
                                                     layer.tm_qweight.clone())


def test_a_deleted_layer_leaves_the_registry(fake_turbomind, one_rank):
    import gc

    before = len(method._LINEARS)
    quant, layer, _ = _loaded_layer(torch.Generator().manual_seed(4))
    assert len(method._LINEARS) == before + 1
    del quant, layer
    gc.collect()
    assert len(method._LINEARS) == before
