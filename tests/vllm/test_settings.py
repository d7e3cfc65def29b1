"""Preset selection: TURBOQUANT_PRESET or --additional-config, validated, logged in one line."""

from __future__ import annotations

import types

import pytest
import torch

from turboquant_vllm.core.presets import PRESETS, get_preset
from turboquant_vllm.vllm import PRESET_CONFIG_KEY, resolve_preset, settings
from turboquant_vllm.vllm.backend import TQ4AttentionBackend
from turboquant_vllm.vllm.settings import describe_preset, process_preset


def config_with(preset=None):
    return types.SimpleNamespace(additional_config={PRESET_CONFIG_KEY: preset} if preset else {})


def test_default_is_tq4():
    assert resolve_preset(None).name == "tq4"
    assert resolve_preset(config_with()).name == "tq4"


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_is_selectable_by_env(name, monkeypatch):
    monkeypatch.setenv("TURBOQUANT_PRESET", name)
    assert resolve_preset(None) == get_preset(name)


def test_there_is_a_sub_3_bit_preset():
    assert any((p.k_bits + p.v_bits) / 2 < 3 for p in PRESETS.values())


def test_env_is_case_and_space_insensitive(monkeypatch):
    monkeypatch.setenv("TURBOQUANT_PRESET", " TQ3 ")
    assert resolve_preset(None).name == "tq3"


def test_unknown_env_preset_names_the_choices(monkeypatch):
    monkeypatch.setenv("TURBOQUANT_PRESET", "tq9")
    with pytest.raises(ValueError) as err:
        resolve_preset(None)
    assert "TURBOQUANT_PRESET" in str(err.value)
    for name in PRESETS:
        assert name in str(err.value)


def test_vllm_additional_config_selects_the_preset(vllm_config):
    assert resolve_preset(config_with("k4v3")).name == "k4v3"
    vllm_config.additional_config = {PRESET_CONFIG_KEY: "tq3"}  # --additional-config '{"turboquant_preset": "tq3"}'
    assert resolve_preset(vllm_config).name == "tq3"


def test_config_and_env_must_agree(monkeypatch):
    monkeypatch.setenv("TURBOQUANT_PRESET", "tq4")
    assert resolve_preset(config_with("tq4")).name == "tq4"
    with pytest.raises(ValueError, match="given twice"):
        resolve_preset(config_with("tq3"))


def test_unknown_config_preset_is_refused_at_validation(monkeypatch):
    from turboquant_vllm.vllm import compat

    monkeypatch.setattr(compat, "current_vllm_config", lambda: config_with("tq0"))
    reasons = TQ4AttentionBackend.validate_configuration(
        head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None, use_mla=False,
        has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
        device_capability=None, attn_type="decoder",
    )
    (reason,) = reasons
    assert PRESET_CONFIG_KEY in reason and "tq0" in reason


def test_process_preset_is_fixed_once(monkeypatch):
    assert process_preset(config_with("tq3")).name == "tq3"
    assert process_preset(None).name == "tq3"  # later callers without a config (get_kv_cache_shape)
    with pytest.raises(ValueError, match="changed within one process"):
        process_preset(config_with("tq4"))


def test_startup_line():
    line = describe_preset(get_preset("tq4"), 128)
    assert "\n" not in line
    assert "tq4" in line and "136 B per token per KV head" in line and "512 B in bf16" in line and "3.76x" in line
    assert "4.92x" in describe_preset(get_preset("tq3"), 128)


def test_startup_line_is_logged_once_per_process(vllm_config, monkeypatch, bf16_default):
    from tests.vllm.conftest import make_layers

    lines = []
    monkeypatch.setattr(settings, "_logged", set())
    monkeypatch.setattr(settings.logger, "info", lambda fmt, *args: lines.append(fmt % args))
    make_layers(vllm_config, 3)
    assert lines == [describe_preset(get_preset("tq4"), 128)]
