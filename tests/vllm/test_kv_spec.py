"""The KV cache really is smaller: the layer's spec carries the compressed page, end to end
through vLLM 0.25's own sizing (engine core) and allocation/reshape code (V1 and V2 runners)."""

from __future__ import annotations

import pickle
import types
from dataclasses import replace

import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from tests.vllm.conftest import make_layers
from turboquant_vllm.core.layout import CacheLayout
from turboquant_vllm.core.presets import PRESETS, get_preset
from turboquant_vllm.vllm import kv_spec
from turboquant_vllm.vllm.backend import TurboQuantAttentionBackend
from turboquant_vllm.vllm.kv_spec import TurboQuantFullAttentionSpec, TurboQuantSlidingWindowSpec


def tq_spec(preset="tq4", block_size=16, kv_heads=8, head_size=128, **kw):
    return TurboQuantFullAttentionSpec(
        block_size=block_size, num_kv_heads=kv_heads, head_size=head_size, dtype=torch.uint8,
        turboquant_preset=preset, **kw,
    )


def bf16_spec(block_size=16, kv_heads=8, head_size=128):
    return FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads, head_size=head_size, dtype=torch.bfloat16)


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_page_size_is_the_compressed_page(preset, head_size, block_size):
    spec = tq_spec(preset, block_size, 8, head_size)
    layout = CacheLayout(get_preset(preset), head_size, 8, block_size)
    assert spec.page_size_bytes == layout.page_bytes == 8 * block_size * layout.bytes_per_token_per_head
    assert spec.page_size_bytes == 8 * layout.head_page_bytes


def test_tq4_is_at_least_3_7x_smaller_than_bf16():
    assert bf16_spec().page_size_bytes / tq_spec("tq4").page_size_bytes >= 3.7


def test_the_layer_reports_the_compressed_spec(vllm_config, bf16_default):
    (layer,) = make_layers(vllm_config, 1)
    spec = layer.get_kv_cache_spec(vllm_config)
    assert type(spec) is TurboQuantFullAttentionSpec
    assert spec.turboquant_preset == "tq4" and spec.dtype == torch.uint8
    assert spec.page_size_bytes == CacheLayout(get_preset("tq4"), 128, 8, 16).page_bytes
    assert spec.block_size == vllm_config.cache_config.block_size


def test_the_layer_spec_follows_the_preset(vllm_config, bf16_default, monkeypatch):
    monkeypatch.setenv("TURBOQUANT_PRESET", "k3v2")
    (layer,) = make_layers(vllm_config, 1)
    spec = layer.get_kv_cache_spec(vllm_config)
    assert spec.turboquant_preset == "k3v2"
    assert spec.page_size_bytes == 8 * 16 * get_preset("k3v2").bytes_per_token_per_head(128)


def test_other_backends_keep_their_spec(vllm_config, bf16_default):
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    make_layers(vllm_config, 1)  # installs the hook
    with set_current_vllm_config(vllm_config):
        other = Attention(32, 128, 0.1, num_kv_heads=8, cache_config=vllm_config.cache_config,
                          prefix="model.layers.1.self_attn.attn", attn_backend=TritonAttentionBackend)
    spec = other.get_kv_cache_spec(vllm_config)
    assert type(spec) is FullAttentionSpec and spec.dtype != torch.uint8


def test_hook_is_installed_once(vllm_config, bf16_default):
    from vllm.model_executor.layers.attention import Attention

    make_layers(vllm_config, 2)
    hooked = Attention.get_kv_cache_spec
    kv_spec.install_kv_cache_spec_hook()
    assert Attention.get_kv_cache_spec is hooked
    assert not getattr(hooked.__turboquant_original__, "__turboquant_hook__", False)


def sliding_layer():
    return types.SimpleNamespace(layer_name="model.layers.0.self_attn.attn")


@pytest.mark.parametrize("hybrid_manager_disabled", [False, True])
def test_sliding_window_layers(vllm_config, hybrid_manager_disabled):
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = hybrid_manager_disabled
    vllm_spec = SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
                                  sliding_window=4096)
    spec = kv_spec.turboquant_kv_cache_spec(sliding_layer(), vllm_config, vllm_spec, get_preset("tq4"))
    expected = TurboQuantFullAttentionSpec if hybrid_manager_disabled else TurboQuantSlidingWindowSpec
    assert type(spec) is expected
    assert spec.sliding_window == 4096
    assert spec.page_size_bytes == tq_spec().page_size_bytes  # same page as the full-attention layers


def test_unsupported_layer_variants_are_refused(vllm_config):
    chunked = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
                                        attention_chunk_size=8192)
    with pytest.raises(ValueError, match="attention variant.*--attention-backend"):
        kv_spec.turboquant_kv_cache_spec(sliding_layer(), vllm_config, chunked, get_preset("tq4"))
    with pytest.raises(ValueError, match="not a TurboQuant spec"):
        kv_spec.check_builder_spec(chunked, ["model.layers.0.self_attn.attn"])


def test_different_value_head_size_is_refused(vllm_config):
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=192, head_size_v=128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="value head size"):
        kv_spec.turboquant_kv_cache_spec(sliding_layer(), vllm_config, spec, get_preset("tq4"))


def test_spec_survives_vllm_transformations():
    spec = tq_spec("tq3")
    assert KVCacheSpecRegistry.get_manager_class(spec).__name__ == "FullAttentionManager"
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(spec) is FullAttentionSpec
    sw = TurboQuantSlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.uint8,
                                     sliding_window=512, turboquant_preset="tq3")
    assert KVCacheSpecRegistry.get_manager_class(sw).__name__ == "SlidingWindowManager"
    merged = TurboQuantFullAttentionSpec.merge([spec, spec])
    assert merged == spec and merged.page_size_bytes == spec.page_size_bytes
    assert pickle.loads(pickle.dumps(spec)) == spec  # workers send specs to the engine core
    bigger = spec.copy_with_new_block_size(32)
    assert type(bigger) is TurboQuantFullAttentionSpec and bigger.page_size_bytes == 2 * spec.page_size_bytes
    assert replace(spec, indexes_kv_by_block_stride=False) == spec
    # vLLM's is_kv_cache_spec_uniform catches AssertionError only: layers of several presets are then grouped
    # as UniformTypeKVCacheSpecs (test_kv_config_of_mixed_presets_is_exact)
    with pytest.raises(AssertionError, match="different TurboQuant presets"):
        TurboQuantFullAttentionSpec.merge([spec, tq_spec("tq4")])
    with pytest.raises(AssertionError):
        TurboQuantFullAttentionSpec.merge([spec, bf16_spec()])


def layer_names(n):
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


def test_engine_sizes_the_pool_in_compressed_blocks(vllm_config):
    """What the engine core turns into "GPU KV cache size: N tokens", for the same memory."""
    names = layer_names(32)
    memory = 8 << 30
    blocks = {}
    for kind, make in (("tq4", lambda: tq_spec("tq4")), ("bf16", bf16_spec)):
        specs = {n: make() for n in names}
        KVCacheSpecRegistry.check_kv_cache_spec_registry(specs)
        with set_current_vllm_config(vllm_config):
            groups = get_kv_cache_groups(vllm_config, specs)
            blocks[kind] = get_kv_cache_config_from_groups(vllm_config, groups, memory).num_blocks
        assert type(groups[0].kv_cache_spec) is type(specs[names[0]])
    assert blocks["tq4"] / blocks["bf16"] >= 3.7


def small_kv_cache_config(vllm_config, n_layers=4):
    names = layer_names(n_layers)
    specs = {n: tq_spec() for n in names}
    with set_current_vllm_config(vllm_config):
        groups = get_kv_cache_groups(vllm_config, specs)
        config = get_kv_cache_config_from_groups(vllm_config, groups, 64 << 20)
    return names, config


def test_v2_runner_allocation_gives_byte_pages(vllm_config):
    from vllm.v1.worker.gpu import attn_utils
    from vllm.v1.worker.utils import AttentionGroup, prepare_kernel_block_sizes

    names, config = small_kv_cache_config(vllm_config)
    # the runners' groups take their layers' backend, bound to the layers' preset (bind_layer_presets)
    tq4 = TurboQuantAttentionBackend.for_preset("tq4")
    groups = [AttentionGroup(tq4, list(names), config.kv_cache_groups[0].kv_cache_spec, 0)]
    kernel_block_sizes = prepare_kernel_block_sizes(config, [groups])
    assert kernel_block_sizes == [16]  # never a split of vLLM's block
    raw = attn_utils._allocate_kv_cache(config, {}, torch.device("cpu"))
    caches = attn_utils._reshape_kv_cache(groups, raw, "auto", kernel_block_sizes, {}, config)
    layout = CacheLayout(get_preset("tq4"), 128, 8, 16)
    for name in names:
        cache = caches[name]
        assert cache.dtype == torch.uint8 and cache.is_contiguous()
        assert tuple(cache.shape) == layout.cache_shape(config.num_blocks)
        assert cache.untyped_storage().nbytes() == config.num_blocks * layout.page_bytes


def test_v1_runner_reshape_gives_byte_pages(vllm_config):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.utils import AttentionGroup

    names, config = small_kv_cache_config(vllm_config)
    # the runners' groups take their layers' backend, bound to the layers' preset (bind_layer_presets)
    tq4 = TurboQuantAttentionBackend.for_preset("tq4")
    groups = [AttentionGroup(tq4, list(names), config.kv_cache_groups[0].kv_cache_spec, 0)]
    raw = {}
    for tensor in config.kv_cache_tensors:  # GPUModelRunner._allocate_kv_cache_tensors
        buffer = torch.zeros(tensor.size, dtype=torch.int8)
        raw.update({n: buffer for n in tensor.shared_by})
    runner = types.SimpleNamespace(  # the state _reshape_kv_cache_tensors reads
        kv_cache_config=config,
        runner_only_attn_layers=set(),
        cache_config=vllm_config.cache_config,
        _kv_cache_spec_attn_group_iterator=lambda: iter(groups),
        _has_mixed_attention_kv_layout=lambda kernel_block_sizes: False,
    )
    caches = GPUModelRunner._reshape_kv_cache_tensors(runner, raw, [16])
    layout = CacheLayout(get_preset("tq4"), 128, 8, 16)
    for name in names:
        assert caches[name].dtype == torch.uint8
        assert tuple(caches[name].shape) == layout.cache_shape(config.num_blocks)
