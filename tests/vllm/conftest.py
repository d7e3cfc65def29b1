"""Fixtures for the vLLM plugin tests: a CPU VllmConfig, no TurboQuant settings in the environment, a CPU workspace."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 16

PRESET_ENV = "TURBOQUANT_PRESET"


@pytest.fixture(autouse=True)
def clean_preset_state(monkeypatch):
    """Each test starts with no TurboQuant setting in the environment."""
    from turboquant_vllm.vllm import settings

    monkeypatch.delenv(PRESET_ENV, raising=False)
    monkeypatch.delenv("TURBOQUANT_LAYER_PRESETS", raising=False)
    monkeypatch.delenv("TURBOQUANT_ALLOW_UNSUPPORTED_VLLM", raising=False)
    monkeypatch.delenv("TURBOQUANT_KEY_CALIBRATION", raising=False)
    monkeypatch.delenv("TURBOQUANT_COLLECT_KEY_STATISTICS", raising=False)
    settings.read_calibration.cache_clear()
    settings.key_statistics.clear()


class FakeVllmConfig(types.SimpleNamespace):
    """A stand-in for a VllmConfig: the attributes given, and weak-referenceable as VllmConfig is (settings.py keys
    each engine's settings by its config)."""


def cpu_vllm_config(**additional_config):
    """A real VllmConfig on the CPU device (no model: model_config is None): one engine's."""
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig(device="cpu"), additional_config=additional_config)


@pytest.fixture
def vllm_config():
    return cpu_vllm_config()


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

    from turboquant_vllm.vllm.backend import TurboQuantAttentionBackend

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
                    attn_backend=TurboQuantAttentionBackend,
                    **kwargs,
                )
            )
    return layers


def runner_specs(vllm_config):
    """Every attention layer's KV-cache spec as vLLM's runners collect it: the layer's spec through its backend's
    customize_spec (vllm.v1.worker.utils.customize_attention_spec), under the engine's config."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    with set_current_vllm_config(vllm_config):
        return get_kv_cache_spec(vllm_config)


def layer_cache(layer, vllm_config, num_blocks):
    """A zeroed cache for one layer as vLLM binds it: [blocks, kv_heads, block_size, state_content_bytes] in its
    spec's dtype (one layer's view of an LBHNC allocation), from the spec the runners collect for the layer."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.utils import customize_attention_spec

    with set_current_vllm_config(vllm_config):
        spec = customize_attention_spec(layer.get_attn_backend(), layer.get_kv_cache_spec(vllm_config))
    return torch.zeros(num_blocks, spec.num_heads, spec.num_states, spec.state_content_size_bytes, dtype=spec.dtype)


def resolve_layout(vllm_config, backends, specs):
    """The KV-cache layout the engine core resolves from the workers' backends and specs, recorded on the config."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout

    names = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    return resolve_kv_cache_layout(vllm_config, [names], list(specs))


def make_builder(vllm_config, layer_names, kv_heads=8, head_size=128, block_size=BLOCK, preset="tq4"):
    """The metadata builder vLLM makes for one attention group, over our spec."""
    from turboquant_vllm.vllm.kv_spec import TurboQuantFullAttentionSpec
    from turboquant_vllm.vllm.metadata import TurboQuantMetadataBuilder

    spec = TurboQuantFullAttentionSpec(
        block_size=block_size, num_kv_heads=kv_heads, head_size=head_size, dtype=torch.uint8, turboquant_preset=preset
    )
    return TurboQuantMetadataBuilder(spec, layer_names, vllm_config, torch.device("cpu"))


def make_cam(q_lens, seq_lens, num_actual_tokens=None, block_table=None, slot_mapping=None):
    """CommonAttentionMetadata as the runners hand it over (query_start_loc on device and on CPU)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    if block_table is None:
        width = max(math.ceil(s / BLOCK) for s in seq_lens)
        block_table = torch.zeros(len(q_lens), width, dtype=torch.int32)
    total = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(),
        query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(q_lens),
        num_actual_tokens=num_actual_tokens or total,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=block_table,
        slot_mapping=slot_mapping if slot_mapping is not None else torch.zeros(total, dtype=torch.int64),
    )


def run_python(code: str, tmp_path: Path, extra_env: dict | None = None) -> dict:
    """Run code in a fresh interpreter (what every vLLM process is) and return its last line as JSON."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.update(extra_env or {})
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
