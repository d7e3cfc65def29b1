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


def test_cloverlm_registers_from_the_entry_point_without_importing_the_model():
    """The entry point makes CloverLMForCausalLM and model_type "cloverlm" known; the model module (vLLM's layers)
    is imported only when vLLM resolves the class."""
    import subprocess

    probe = ("import sys\nfrom turboquant_vllm import plugins\nplugins.register()\n"
             "from transformers import AutoConfig\nfrom vllm import ModelRegistry\n"
             "assert 'CloverLMForCausalLM' in ModelRegistry.get_supported_archs()\n"
             "assert AutoConfig.for_model('cloverlm').__class__.__name__ == 'CloverLMConfig'\n"
             "assert 'turboquant_vllm.models.cloverlm.vllm_model' not in sys.modules\n"
             "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
    assert plugins.PLUGINS["cloverlm"] == "turboquant_vllm.models.cloverlm:register"
