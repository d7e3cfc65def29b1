"""The one entry point registers every plugin; a plugin that cannot import never stops the others."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from turboquant_vllm import plugins


def fake_plugin(monkeypatch, name: str, calls: list[str]) -> str:
    module = types.ModuleType(name)
    module.register = lambda: calls.append(name)
    monkeypatch.setitem(sys.modules, name, module)
    return f"{name}:register"


def test_every_plugin_registers(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(plugins, "PLUGINS", {"a": fake_plugin(monkeypatch, "fake_a", calls),
                                             "b": fake_plugin(monkeypatch, "fake_b", calls)})
    plugins.register()
    assert calls == ["fake_a", "fake_b"]


def test_a_plugin_that_cannot_import_is_skipped_with_its_reason(monkeypatch, caplog):
    calls: list[str] = []
    monkeypatch.setattr(plugins, "PLUGINS", {"missing": "no_such_module_anywhere:register",
                                             "b": fake_plugin(monkeypatch, "fake_b", calls)})
    with caplog.at_level(logging.WARNING, logger="vllm.turboquant_vllm"):
        plugins.register()
    assert calls == ["fake_b"]
    assert "plugin missing not registered" in caplog.text and "no_such_module_anywhere" in caplog.text


def test_a_wrong_setting_still_fails_at_startup(monkeypatch):
    def refuse():
        raise ValueError("TURBOQUANT_PRESET: unknown TurboQuant preset 'bogus'")

    module = types.ModuleType("fake_refusing")
    module.register = refuse
    monkeypatch.setitem(sys.modules, "fake_refusing", module)
    monkeypatch.setattr(plugins, "PLUGINS", {"kv": "fake_refusing:register"})
    with pytest.raises(ValueError, match="bogus"):
        plugins.register()


def test_the_quantization_methods_register_with_vllm():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    plugins.register()
    for name in ("awq_turbomind", "quartet2"):
        assert name in QUANTIZATION_METHODS and get_quantization_config(name).__name__.endswith("Config")


def test_a_fresh_process_registers_every_plugin_through_vllms_loader_lazily(tmp_path):
    """vLLM runs the entry point in every process (the API server's too), through its plugin loader. One fresh
    process checks each plugin's registration (a vLLM import costs ~15 s a process):
    - the KV-cache backend: CUSTOM resolves to ours (twice loaded: idempotent) without touching CUDA, the backend
      module, the kernels or vLLM's internals; importing the backend and customizing a spec touch no CUDA either;
    - CloverLM: CloverLMForCausalLM and model_type "cloverlm" known, the model module (vLLM's layers) imported only
      when vLLM resolves the class;
    - the weight methods: registering imports neither vLLM's linear layers nor the methods' layer modules (the
      torch op, the Triton kernels); `-q awq_turbomind` and `-q quartet2` resolve to their config classes and answer
      override_quantization_method without them; building a config or a layer imports them, the awq_turbomind op
      registered as the config is built (before any model is built or compiled)."""
    from tests.vllm.conftest import run_python
    from tests.vllm.test_plugin import declared_entry_point, fake_distribution

    fake_distribution(tmp_path)
    out = run_python(
        """
        import json, os, sys, types
        import torch
        from vllm.plugins import load_general_plugins
        HEAVY = ["vllm.model_executor.layers.linear", "turboquant_vllm.quant.awq_turbomind.method",
                 "turboquant_vllm.quant.quartet2.plugin.method",
                 "turboquant_vllm.quant.quartet2.kernels.quantize.quantize"]
        loaded = lambda: [m for m in HEAVY if m in sys.modules]
        load_general_plugins()
        load_general_plugins()
        out = {"registered": loaded(), "cuda_initialized": torch.cuda.is_initialized(),
               "backend_imported": "turboquant_vllm.vllm.backend" in sys.modules,
               "kernels_imported": "turboquant_vllm.ops" in sys.modules,
               "vllm_internals_imported": "turboquant_vllm.vllm.compat" in sys.modules}
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        out["path"] = AttentionBackendEnum.CUSTOM.get_path()

        from transformers import AutoConfig
        from vllm import ModelRegistry
        out["clover"] = ["CloverLMForCausalLM" in ModelRegistry.get_supported_archs(),
                         AutoConfig.for_model("cloverlm").__class__.__name__,
                         "turboquant_vllm.models.cloverlm.vllm_model" in sys.modules]

        import turboquant_vllm.vllm as plugin
        plugin.register()
        backend = plugin.TurboQuantAttentionBackend
        from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        vllm_spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
        with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
            spec = backend.for_preset("tq4").customize_spec(vllm_spec)
        out["backend"] = {"cuda_initialized": torch.cuda.is_initialized(), "page": spec.page_size_bytes}

        from vllm.model_executor.layers.quantization import get_quantization_config
        awq, q2 = get_quantization_config("awq_turbomind"), get_quantization_config("quartet2")
        awq_cfg = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
        clover = {"producer": {"name": "cloverlm_converter"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16}}
        out["classes"] = [awq.__name__, q2.__name__]
        out["claims"] = [awq.override_quantization_method(awq_cfg, "awq_turbomind"),
                         q2.override_quantization_method(clover, None), q2.override_quantization_method(awq_cfg, None)]
        out["resolved"] = loaded()
        fake = types.ModuleType("turbomind")
        fake.Linear = type("Linear", (), {"clear_workspaces": staticmethod(lambda: None)})
        sys.modules["turbomind"] = fake
        awq.from_config(awq_cfg)
        out["awq_built"] = [loaded(), hasattr(torch.ops.turboquant_vllm, "awq_turbomind_gemm")]
        os.environ["TURBOQUANT_QUARTET2_PATH"] = "emulate"
        config = q2.from_config({})
        from vllm.model_executor.layers.linear import ReplicatedLinear
        out["q2_layer"] = type(config.get_quant_method(object.__new__(ReplicatedLinear), "mlp")).__name__
        out["q2_built"] = loaded()
        print(json.dumps(out))
        """,
        tmp_path,
        {"VLLM_PLUGINS": declared_entry_point()[0]},
    )
    # the KV-cache backend
    assert out["path"] == "turboquant_vllm.vllm.TurboQuantAttentionBackend"
    assert [out[k] for k in ("cuda_initialized", "backend_imported", "kernels_imported", "vllm_internals_imported")] \
        == [False] * 4
    assert out["backend"] == {"cuda_initialized": False, "page": 8 * 16 * 136}
    # CloverLM
    assert out["clover"] == [True, "CloverLMConfig", False]
    assert plugins.PLUGINS["cloverlm"] == "turboquant_vllm.models.cloverlm:register"
    # the weight methods
    assert out["registered"] == []
    assert out["classes"] == ["AWQTurboMindConfig", "Quartet2Config"]
    assert out["claims"] == ["awq_turbomind", "quartet2", None]
    # vLLM's get_quantization_config imports its own configs, and with them its linear layers; ours stay unloaded
    assert out["resolved"] == ["vllm.model_executor.layers.linear"]
    assert out["awq_built"] == [["vllm.model_executor.layers.linear", "turboquant_vllm.quant.awq_turbomind.method"],
                                True]
    assert out["q2_layer"] == "Quartet2LinearMethod"
    assert "turboquant_vllm.quant.quartet2.plugin.method" in out["q2_built"]
    assert plugins.PLUGINS["quartet2"] == "turboquant_vllm.quant.quartet2:register"
