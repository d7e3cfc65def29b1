"""Fixtures for the vLLM plugin tests: a CPU VllmConfig, clean preset state, a CPU workspace."""

from __future__ import annotations

import pytest
import torch

PRESET_ENV = "TURBOQUANT_PRESET"


@pytest.fixture(autouse=True)
def clean_preset_state(monkeypatch):
    """Each test starts with no preset in the environment and none fixed for the process."""
    from turboquant_vllm.vllm import backend

    monkeypatch.delenv(PRESET_ENV, raising=False)
    monkeypatch.delenv("TURBOQUANT_ALLOW_UNSUPPORTED_VLLM", raising=False)
    monkeypatch.setattr(backend, "_process_preset", None)


@pytest.fixture
def vllm_config():
    """A real VllmConfig on the CPU device (no model: model_config is None)."""
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig(device="cpu"))


@pytest.fixture
def workspace():
    """vLLM's workspace manager on the CPU, as a GPU worker initializes it before building the model."""
    from vllm.v1.worker import workspace as ws

    ws.init_workspace_manager(torch.device("cpu"))
    yield ws.current_workspace_manager()
    ws.reset_workspace_manager()


def workspace_bytes(manager) -> int:
    return sum(manager._workspace_size_bytes(w) for w in manager._current_workspaces)


@pytest.fixture
def bf16_default():
    """vLLM builds models with the activation dtype as torch's default dtype."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    yield
    torch.set_default_dtype(old)


def make_layers(vllm_config, n, *, num_heads=32, num_kv_heads=8, head_size=128, first=0, **kwargs):
    """n real vLLM Attention layers on the CUSTOM backend, as a model's __init__ would build them."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention

    from turboquant_vllm.vllm.backend import TQ4AttentionBackend

    layers = []
    with set_current_vllm_config(vllm_config):
        for i in range(first, first + n):
            layers.append(
                Attention(
                    num_heads=num_heads,
                    head_size=head_size,
                    scale=head_size**-0.5,
                    num_kv_heads=num_kv_heads,
                    cache_config=vllm_config.cache_config,
                    prefix=f"model.layers.{i}.self_attn.attn",
                    attn_backend=TQ4AttentionBackend,
                    **kwargs,
                )
            )
    return layers
