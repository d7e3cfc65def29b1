"""The vLLM releases supported: vLLM outside the tested range is refused at startup with the range named."""

from __future__ import annotations

import pytest

from tests.vllm.conftest import run_python
from turboquant_vllm.vllm import requirements


@pytest.mark.parametrize(
    "version, ok",
    [
        ("0.33.0", True),
        ("0.33.1", True),
        ("0.33.2.dev14+g0123abc", True),
        ("0.25.0", False),
        ("0.32.0", False),
        ("0.34.0rc1", False),
        ("0.28.0", False),
        ("1.0.0", False),
        ("not-a-version", False),
    ],
)
def test_supported_range(version, ok):
    assert requirements.is_supported_vllm(version) is ok


def test_installed_vllm_is_supported():
    assert requirements.check_vllm_version() == requirements.installed_vllm_version()


def test_unsupported_version_names_the_range():
    with pytest.raises(requirements.UnsupportedVLLMVersion) as err:
        requirements.check_vllm_version("0.28.0")
    message = str(err.value)
    assert ">=0.33,<0.34" in message and "0.28.0" in message
    assert not isinstance(err.value, ImportError)  # vLLM's selector would swallow an ImportError


def test_override_only_warns(monkeypatch):
    monkeypatch.setenv(requirements.ALLOW_UNSUPPORTED_ENV, "1")
    assert requirements.check_vllm_version("0.28.0") == "0.28.0"


def test_backend_resolution_refuses_an_unsupported_vllm(monkeypatch):
    import turboquant_vllm.vllm as plugin

    monkeypatch.setattr(requirements, "installed_vllm_version", lambda: "0.28.0")
    for name in plugin.BACKEND_NAMES:  # what vLLM resolves for CUSTOM, and the older name deployments give
        with pytest.raises(requirements.UnsupportedVLLMVersion, match=r">=0\.33,<0\.34"):
            getattr(plugin, name)


def test_fresh_process_with_unsupported_vllm(tmp_path):
    """register() only warns (other backends keep working); selecting CUSTOM fails naming the range."""
    out = run_python(
        """
        import importlib.metadata as md, json
        real = md.version
        md.version = lambda name: "0.28.0" if name == "vllm" else real(name)
        import turboquant_vllm.vllm as plugin
        plugin.register()
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        try:
            AttentionBackendEnum.CUSTOM.get_class()
            error = None
        except Exception as exc:
            error = [type(exc).__name__, str(exc)]
        print(json.dumps({"path": AttentionBackendEnum.CUSTOM.get_path(), "error": error}))
        """,
        tmp_path,
    )
    assert out["path"] == "turboquant_vllm.vllm.TurboQuantAttentionBackend"
    assert out["error"][0] == "UnsupportedVLLMVersion"
    assert ">=0.33,<0.34" in out["error"][1] and "0.28.0" in out["error"][1]
