"""The backend's class-level contract with vLLM's selector: name, sizes, dtypes, refusals."""

from __future__ import annotations

import types

import pytest
import torch
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, MultipleOf

from tests.vllm.conftest import FakeVllmConfig
from turboquant_vllm.core.layout import CacheLayout
from turboquant_vllm.core.presets import PRESETS, get_preset
from turboquant_vllm.vllm import compat
from turboquant_vllm.vllm.backend import TurboQuantAttentionBackend
from turboquant_vllm.vllm.impl import TurboQuantAttentionImpl
from turboquant_vllm.vllm.kv_spec import config_problems
from turboquant_vllm.vllm.metadata import TurboQuantMetadataBuilder

H200 = DeviceCapability(9, 0)


def validate(**overrides) -> list[str]:
    """What vLLM's CUDA platform calls for --attention-backend CUSTOM, once per layer shape."""
    cfg = dict(
        head_size=128,
        dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        block_size=None,
        use_mla=False,
        has_sink=False,
        use_sparse=False,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=H200,
        attn_type=AttentionType.DECODER,
        use_non_causal=False,
        use_batch_invariant=False,
        use_kv_connector=False,
    )
    cfg.update(overrides)
    return TurboQuantAttentionBackend.validate_configuration(**cfg)


def test_name_impl_builder():
    assert TurboQuantAttentionBackend.get_name() == "CUSTOM"
    assert TurboQuantAttentionBackend.get_impl_cls() is TurboQuantAttentionImpl
    assert TurboQuantAttentionBackend.get_builder_cls() is TurboQuantMetadataBuilder
    # forward stores (with the queries' rotation)
    assert TurboQuantAttentionBackend.forward_includes_kv_cache_update is True
    assert TurboQuantAttentionBackend.is_mla() is False


def test_a_plain_decoder_layer_is_valid():
    assert validate() == []
    assert validate(dtype=torch.float16, block_size=32, kv_cache_dtype="bfloat16") == []


@pytest.mark.parametrize("head_size", [32, 64, 80, 96, 112, 128, 192, 256])
def test_supported_head_sizes(head_size):
    assert TurboQuantAttentionBackend.supports_head_size(head_size)
    assert head_size in TurboQuantAttentionBackend.get_supported_head_sizes()
    assert validate(head_size=head_size) == []


@pytest.mark.parametrize("head_size", [16, 72, 100, 257, 512])
def test_unsupported_head_sizes_are_refused_with_the_constraint(head_size):
    assert not TurboQuantAttentionBackend.supports_head_size(head_size)
    (reason,) = validate(head_size=head_size)
    assert f"head size {head_size}" in reason and "multiple of 16" in reason and "--attention-backend" in reason


def test_dtypes():
    assert TurboQuantAttentionBackend.supports_dtype(torch.bfloat16)
    assert TurboQuantAttentionBackend.supports_dtype(torch.float16)
    assert not TurboQuantAttentionBackend.supports_dtype(torch.float32)
    (reason,) = validate(dtype=torch.float32)
    assert "--dtype bfloat16" in reason


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "int8_per_token_head", "turboquant_4bit_nc"])
def test_other_kv_cache_dtypes_are_refused(kv_cache_dtype):
    (reason,) = validate(kv_cache_dtype=kv_cache_dtype)
    assert "drop --kv-cache-dtype" in reason


def test_block_sizes():
    assert TurboQuantAttentionBackend.get_supported_kernel_block_sizes() == [MultipleOf(16)]
    assert TurboQuantAttentionBackend.get_supported_kernel_block_sizes(None) == [MultipleOf(16)]  # vLLM passes a spec
    for ok in (16, 32, 64, 128, 256, 544):
        assert TurboQuantAttentionBackend.supports_block_size(ok)
    (reason,) = validate(block_size=8)
    assert "multiple of 16" in reason


def test_mla_is_refused():
    reasons = validate(use_mla=True, head_size=576)
    assert any("MLA" in r and "--attention-backend" in r for r in reasons)


@pytest.mark.parametrize(
    "attn_type", [AttentionType.ENCODER, AttentionType.ENCODER_ONLY, AttentionType.ENCODER_DECODER]
)
def test_encoder_and_cross_attention_are_refused(attn_type):
    assert not TurboQuantAttentionBackend.supports_attn_type(attn_type)
    (reason,) = validate(attn_type=attn_type)
    assert "decoder self-attention" in reason and "--attention-backend" in reason


@pytest.mark.parametrize(
    "flag, needle",
    [
        ("has_sink", "sinks"),
        ("use_sparse", "sparse"),
        ("use_mm_prefix", "multimodal"),
        ("use_non_causal", "non-causal"),
        ("use_kv_connector", "--kv-transfer-config"),
        ("use_per_head_quant_scales", "per-head"),
    ],
)
def test_unsupported_features_are_refused(flag, needle):
    (reason,) = validate(**{flag: True})
    assert needle in reason


def test_compute_capability():
    assert TurboQuantAttentionBackend.supports_batch_invariance()
    assert TurboQuantAttentionBackend.supports_compute_capability(DeviceCapability(8, 0))
    assert TurboQuantAttentionBackend.supports_compute_capability(H200)
    (reason,) = validate(device_capability=DeviceCapability(7, 5))
    assert "8.0" in reason


def test_cuda_graph_support_covers_uniform_decode_batches():
    support = TurboQuantMetadataBuilder.get_cudagraph_support(None, None)
    assert support.value >= AttentionCGSupport.UNIFORM_BATCH.value


def test_customize_spec_is_the_compressed_page(vllm_config):
    """vLLM 0.33 asks the backend for the layer's spec (customize_spec), not for a cache shape: the runner views each
    layer's cache as [blocks, kv_heads, block_size, state_content_bytes] of the spec's dtype."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    vllm_spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    with set_current_vllm_config(vllm_config):
        spec = TurboQuantAttentionBackend.for_preset("tq4").customize_spec(vllm_spec)
    layout = CacheLayout(get_preset("tq4"), 128, 8, 16)
    assert spec.dtype == torch.uint8 and spec.state_content_bytes == layout.bytes_per_token_per_head == 136
    assert (spec.num_heads, spec.num_states, spec.state_content_size_bytes) == (8, 16, 136)
    assert spec.page_size_bytes == layout.page_bytes
    assert not hasattr(TurboQuantAttentionBackend, "get_kv_cache_shape")


def test_the_unbound_backend_uses_the_engines_preset(vllm_config, monkeypatch):
    """vLLM may ask before the model is built (the layer's backend is then this class itself): the engine's preset."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    monkeypatch.setenv("TURBOQUANT_PRESET", "tq3")
    vllm_spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=128, dtype=torch.bfloat16)
    with set_current_vllm_config(vllm_config):
        assert TurboQuantAttentionBackend.customize_spec(vllm_spec).turboquant_preset == "tq3"
        assert TurboQuantAttentionBackend.for_preset("k3v2").customize_spec(vllm_spec).turboquant_preset == "k3v2"
    k3v2 = TurboQuantAttentionBackend.for_preset("k3v2")
    assert k3v2 is TurboQuantAttentionBackend.for_preset("k3v2") and k3v2.__name__ == "TurboQuantAttentionBackend_k3v2"
    assert issubclass(k3v2, TurboQuantAttentionBackend) and k3v2.get_name() == "CUSTOM"


def test_layouts_and_sliding_windows():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    # the kernels read a (block, KV head) page as contiguous bytes; blocks at any stride
    assert TurboQuantAttentionBackend.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)
    assert TurboQuantAttentionBackend.for_preset("tq3").supported_kv_cache_layouts() == (
        KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)
    assert TurboQuantAttentionBackend.supports_sliding_window()


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_serves_every_supported_head_size(preset, monkeypatch):
    monkeypatch.setenv("TURBOQUANT_PRESET", preset)
    assert [validate(head_size=d) for d in (32, 64, 96, 128, 256)] == [[]] * 5


def fake_config(**parts):
    base = dict(
        model_config=types.SimpleNamespace(is_hybrid=False, use_mla=False),
        cache_config=types.SimpleNamespace(kv_cache_dtype_skip_layers=[]),
        parallel_config=types.SimpleNamespace(
            decode_context_parallel_size=1, prefill_context_parallel_size=1, enable_dbo=False
        ),
        additional_config={},
    )
    for key, value in parts.items():
        section, attr = key.split("__")
        setattr(base[section], attr, value)
    return FakeVllmConfig(**base)


@pytest.mark.parametrize(
    "setting, needle",
    [
        ({"model_config__is_hybrid": True}, "Mamba"),
        ({"model_config__use_mla": True}, "MLA"),
        ({"cache_config__kv_cache_dtype_skip_layers": ["0"]}, "--kv-cache-dtype-skip-layers"),
        ({"parallel_config__decode_context_parallel_size": 2}, "context parallelism"),
        ({"parallel_config__prefill_context_parallel_size": 2}, "context parallelism"),
        ({"parallel_config__enable_dbo": True}, "--enable-dbo"),
    ],
)
def test_config_level_refusals(setting, needle, monkeypatch):
    assert config_problems(fake_config()) == []
    cfg = fake_config(**setting)
    (problem,) = config_problems(cfg)
    assert needle in problem
    monkeypatch.setattr(compat, "current_vllm_config", lambda: cfg)
    assert any(needle in r for r in validate())


def test_impl_refuses_what_it_cannot_run(vllm_config):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        with pytest.raises(ValueError, match="ALiBi"):
            TurboQuantAttentionImpl(8, 128, 0.1, 8, [0.5] * 8, None, "auto")
        with pytest.raises(ValueError, match="decoder self-attention"):
            TurboQuantAttentionImpl(8, 128, 0.1, 8, None, None, "auto", attn_type=AttentionType.ENCODER_DECODER)
        with pytest.raises(ValueError, match="sinks"):
            TurboQuantAttentionImpl(8, 128, 0.1, 8, None, None, "auto", sinks=torch.zeros(8))
        with pytest.raises(ValueError, match="head_dim"):
            TurboQuantAttentionImpl(8, 72, 0.1, 8, None, None, "auto")
        with pytest.raises(ValueError, match="chunk_lookback"):
            TurboQuantAttentionImpl(8, 128, 0.1, 8, None, None, "auto", chunk_lookback=512)
        # options passed with their "off" value are fine
        TurboQuantAttentionImpl(8, 128, 0.1, 8, None, None, "auto", chunk_lookback=-1, sinks=None)
