"""The KV-cache plugin's registration: entry point, idempotence, refused settings. Through vLLM's own plugin loader
in a fresh process, without CUDA: tests/test_plugins.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.vllm.conftest import ROOT

GROUP = "vllm.general_plugins"


def declared_entry_point() -> tuple[str, str]:
    """(name, target) of the one vllm.general_plugins entry point in pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(r'^\[project\.entry-points\."vllm\.general_plugins"\]\n((?:[^\[\n].*\n?)*)', text, re.M)
    assert section, "pyproject.toml declares no vllm.general_plugins entry point"
    eps = re.findall(r'^\s*([\w.-]+)\s*=\s*"([^"]+)"', section.group(1), re.M)
    assert len(eps) == 1, eps
    return eps[0]


def test_entry_point_is_declared():
    name, target = declared_entry_point()
    assert target == "turboquant_vllm.plugins:register"
    from turboquant_vllm import plugins

    assert plugins.PLUGINS["turboquant-kv-cache"] == "turboquant_vllm.vllm:register"


def test_register_is_idempotent_and_registers_custom():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import turboquant_vllm.vllm as plugin
    from turboquant_vllm.vllm.backend import TurboQuantAttentionBackend

    plugin.register()
    plugin.register()
    assert AttentionBackendEnum.CUSTOM.get_path() == "turboquant_vllm.vllm.TurboQuantAttentionBackend"
    assert AttentionBackendEnum.CUSTOM.get_class() is TurboQuantAttentionBackend
    assert plugin.TurboQuantAttentionBackend is TurboQuantAttentionBackend
    assert plugin.TQ4AttentionBackend is TurboQuantAttentionBackend  # the older name, which deployments give
    assert TurboQuantAttentionBackend.get_name() == "CUSTOM"
    assert AttentionBackendEnum[TurboQuantAttentionBackend.get_name()] is AttentionBackendEnum.CUSTOM


@pytest.mark.parametrize("env, value, needle", [("TURBOQUANT_PRESET", "tq7", "TURBOQUANT_PRESET.*tq4"),
                                                ("TURBOQUANT_LAYER_PRESETS", "0=tq7", "TURBOQUANT_LAYER_PRESETS.*tq7")])
def test_register_refuses_a_bad_setting(monkeypatch, env, value, needle):
    import turboquant_vllm.vllm as plugin

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=needle):
        plugin.register()


def fake_distribution(tmp_path: Path) -> None:
    """Installed-package metadata carrying pyproject's entry point, as `pip install` would write it."""
    name, target = declared_entry_point()
    dist = tmp_path / "turboquant_vllm-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: turboquant-vllm\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(f"[{GROUP}]\n{name} = {target}\n")
