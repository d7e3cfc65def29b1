"""The TurboQuant settings: the preset, per-layer presets and key calibration from --additional-config or the
environment, resolved once per engine into one immutable object, validated, logged in one line."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from tests.vllm.conftest import FakeVllmConfig
from turboquant_vllm.core.presets import PRESETS, get_preset
from turboquant_vllm.vllm import PRESET_CONFIG_KEY, TurboQuantSettings, resolve_settings, settings
from turboquant_vllm.vllm.backend import TurboQuantAttentionBackend
from turboquant_vllm.vllm.settings import (
    CALIBRATION_CONFIG_KEY,
    CALIBRATION_ENV,
    LAYER_PRESETS_CONFIG_KEY,
    LAYER_PRESETS_ENV,
    describe_preset,
    engine_settings,
)


def config_with(preset=None, **extra):
    return FakeVllmConfig(additional_config={PRESET_CONFIG_KEY: preset, **extra} if preset else extra)


def test_default_is_tq4():
    assert resolve_settings(None) == TurboQuantSettings(get_preset("tq4"), "default")
    assert resolve_settings({}).preset.name == "tq4"


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_is_selectable_by_env(name, monkeypatch):
    monkeypatch.setenv("TURBOQUANT_PRESET", name)
    assert resolve_settings(None).preset == get_preset(name)
    assert resolve_settings(None).preset_source == "TURBOQUANT_PRESET"


def test_there_is_a_sub_3_bit_preset():
    assert any((p.k_bits + p.v_bits) / 2 < 3 for p in PRESETS.values())


def test_env_is_case_and_space_insensitive(monkeypatch):
    monkeypatch.setenv("TURBOQUANT_PRESET", " TQ3 ")
    assert resolve_settings(None).preset.name == "tq3"


def test_unknown_env_preset_names_the_choices(monkeypatch):
    monkeypatch.setenv("TURBOQUANT_PRESET", "tq9")
    with pytest.raises(ValueError) as err:
        resolve_settings(None)
    assert str(err.value).startswith("TURBOQUANT_PRESET: unknown TurboQuant preset 'tq9'")
    for name in PRESETS:
        assert name in str(err.value)


def test_vllm_additional_config_selects_the_preset(vllm_config):
    assert resolve_settings({PRESET_CONFIG_KEY: "k4v3"}).preset.name == "k4v3"
    vllm_config.additional_config = {PRESET_CONFIG_KEY: "tq3"}  # --additional-config '{"turboquant_preset": "tq3"}'
    found = engine_settings(vllm_config)
    assert found.preset.name == "tq3" and found.preset_source == f"--additional-config {PRESET_CONFIG_KEY}"


def test_the_environment_can_be_given(monkeypatch):
    monkeypatch.setenv("TURBOQUANT_PRESET", "tq2")
    assert resolve_settings(None, {"TURBOQUANT_PRESET": "k5v4"}).preset.name == "k5v4"
    assert resolve_settings(None, {}).preset.name == "tq4"


def test_config_and_env_must_agree(monkeypatch):
    monkeypatch.setenv("TURBOQUANT_PRESET", "tq4")
    assert resolve_settings({PRESET_CONFIG_KEY: "TQ4"}).preset.name == "tq4"  # the same preset given twice
    with pytest.raises(ValueError, match="preset given twice: --additional-config turboquant_preset='tq3' and "
                                         "TURBOQUANT_PRESET='tq4'; keep one of them"):
        resolve_settings({PRESET_CONFIG_KEY: "tq3"})


def test_calibration_given_twice_must_be_one_file(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(CALIBRATION_ENV, str(tmp_path / "keys.safetensors"))
    found = resolve_settings({CALIBRATION_CONFIG_KEY: "keys.safetensors"})  # the same file, relative
    assert found.calibration_path == "keys.safetensors"
    assert found.calibration_source == f"--additional-config {CALIBRATION_CONFIG_KEY}"
    with pytest.raises(ValueError, match="key calibration given twice.*keep one of them"):
        resolve_settings({CALIBRATION_CONFIG_KEY: "other.safetensors"})
    assert resolve_settings(None).calibration_source == CALIBRATION_ENV


def test_unknown_config_preset_is_refused_at_validation(monkeypatch):
    from turboquant_vllm.vllm import compat

    monkeypatch.setattr(compat, "current_vllm_config", lambda: config_with("tq0"))
    reasons = TurboQuantAttentionBackend.validate_configuration(
        head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None, use_mla=False,
        has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
        device_capability=None, attn_type="decoder",
    )
    (reason,) = reasons
    assert PRESET_CONFIG_KEY in reason and "tq0" in reason


def test_settings_are_one_immutable_object():
    found = resolve_settings({PRESET_CONFIG_KEY: "tq3", LAYER_PRESETS_CONFIG_KEY: {"0": "bf16"}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        found.preset = get_preset("tq4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        found.layer_presets.entries = ()
    assert found.turboquant_presets() == {get_preset("tq3")}


def test_an_engine_resolves_its_settings_once(monkeypatch, vllm_config, bf16_default):
    """The selector, every layer's impl and the backend's customize_spec of one engine share one TurboQuantSettings,
    resolved once; another engine's config resolves its own; nothing outlives the config."""
    from tests.vllm.conftest import make_layers, runner_specs

    calls = []
    resolve = settings.resolve_settings
    monkeypatch.setattr(settings, "resolve_settings", lambda *a: calls.append(a) or resolve(*a))
    vllm_config.additional_config = {PRESET_CONFIG_KEY: "k4v3"}
    layers = make_layers(vllm_config, 3)
    specs = runner_specs(vllm_config).values()  # the unbound backend's customize_spec: the engine's preset
    assert len(calls) == 1
    assert len({id(layer.impl.settings) for layer in layers}) == 1
    assert layers[0].impl.settings is engine_settings(vllm_config) and len(calls) == 1
    assert {spec.turboquant_preset for spec in specs} == {"k4v3"}
    other = config_with("tq3")
    assert engine_settings(other).preset.name == "tq3" and len(calls) == 2
    key = id(other)
    del other
    gc.collect()
    assert key not in settings._engine_settings


def test_settings_describe_what_vllm_serve_does(monkeypatch):
    monkeypatch.setenv("TURBOQUANT_PRESET", "tq3")
    monkeypatch.setenv(LAYER_PRESETS_ENV, "0,1=bf16;5-7=k4v3")
    assert resolve_settings(None).describe() == (
        "preset: tq3 (from TURBOQUANT_PRESET); layer presets: 0,1=bf16 5-7=k4v3 (from TURBOQUANT_LAYER_PRESETS; the "
        "other layers tq3); key calibration: none")
    assert resolve_settings(None, {CALIBRATION_ENV: "k.safetensors"}).describe() == (
        "preset: tq4 (the default); key calibration: k.safetensors (from TURBOQUANT_KEY_CALIBRATION)")


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
