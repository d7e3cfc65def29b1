"""The KV cache really is smaller: the backend's customize_spec gives each layer the compressed page, end to end
through vLLM 0.33's own spec collection (customize_attention_spec), layout resolution, pool sizing
(kv_cache_planning) and allocation (allocate_kv_cache), whose per-layer view impl.pages_of turns into the kernels'
pages without a copy."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
from vllm.v1.worker.utils import customize_attention_spec

from tests.vllm.conftest import make_layers, resolve_layout, runner_specs
from turboquant_vllm.core.layout import CacheLayout
from turboquant_vllm.core.presets import PRESETS, get_preset
from turboquant_vllm.ops.utils import check_cache
from turboquant_vllm.vllm import kv_spec
from turboquant_vllm.vllm.backend import TurboQuantAttentionBackend
from turboquant_vllm.vllm.impl import pages_of
from turboquant_vllm.vllm.kv_spec import TurboQuantFullAttentionSpec, TurboQuantSlidingWindowSpec

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 64, 16


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
    assert spec.state_content_bytes == layout.bytes_per_token_per_head  # C of vLLM's [B, H, N, C] page
    assert spec.page_size_bytes == layout.page_bytes == 8 * block_size * layout.bytes_per_token_per_head
    assert spec.page_size_bytes == 8 * layout.head_page_bytes


def test_tq4_is_at_least_3_7x_smaller_than_bf16():
    assert bf16_spec().page_size_bytes / tq_spec("tq4").page_size_bytes >= 3.7


def test_the_runners_spec_of_a_layer_is_the_compressed_page(vllm_config, bf16_default):
    (layer,) = make_layers(vllm_config, 1)
    built = layer.get_kv_cache_spec(vllm_config)  # what vLLM builds, before the backend shapes it
    assert type(built) is FullAttentionSpec and built.dtype in (torch.float16, torch.bfloat16)
    (spec,) = runner_specs(vllm_config).values()
    with set_current_vllm_config(vllm_config):
        assert customize_attention_spec(layer.get_attn_backend(), built) == spec
    assert type(spec) is TurboQuantFullAttentionSpec
    assert spec.turboquant_preset == "tq4" and spec.dtype == torch.uint8
    assert spec.page_size_bytes == CacheLayout(get_preset("tq4"), 128, 8, 16).page_bytes
    assert spec.block_size == vllm_config.cache_config.block_size
    # the block is never split: no kernel-block alignment asked of vLLM's planner
    assert spec.block_stride_alignment is None and spec.get_block_stride_alignment() == 1


def test_the_layer_spec_follows_the_preset(vllm_config, bf16_default, monkeypatch):
    monkeypatch.setenv("TURBOQUANT_PRESET", "k3v2")
    make_layers(vllm_config, 1)
    (spec,) = runner_specs(vllm_config).values()
    assert spec.turboquant_preset == "k3v2"
    assert spec.page_size_bytes == 8 * 16 * get_preset("k3v2").bytes_per_token_per_head(128)


def test_a_presets_backend_gives_its_own_page(vllm_config, bf16_default):
    """bind_layer_presets gives a layer for_preset(name): its customize_spec uses that preset, not the engine's."""
    with set_current_vllm_config(vllm_config):
        spec = customize_attention_spec(TurboQuantAttentionBackend.for_preset("tq3"), bf16_spec())
        assert customize_attention_spec(TurboQuantAttentionBackend, bf16_spec()).turboquant_preset == "tq4"
    assert type(spec) is TurboQuantFullAttentionSpec and spec.turboquant_preset == "tq3"
    assert spec.page_size_bytes == CacheLayout(get_preset("tq3"), 128, 8, 16).page_bytes


def test_other_backends_keep_their_spec(vllm_config, bf16_default):
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    make_layers(vllm_config, 1)
    with set_current_vllm_config(vllm_config):
        other = Attention(32, 128, 0.1, num_kv_heads=8, cache_config=vllm_config.cache_config,
                          prefix="model.layers.1.self_attn.attn", attn_backend=TritonAttentionBackend)
    specs = runner_specs(vllm_config)
    assert type(specs["model.layers.0.self_attn.attn"]) is TurboQuantFullAttentionSpec
    spec = specs[other.layer_name]
    assert type(spec) is FullAttentionSpec and spec.dtype in (torch.float16, torch.bfloat16)
    assert spec.page_size_bytes == 16 * 8 * 2 * 128 * 2


@pytest.mark.parametrize("block_size", [16, 32])
def test_sliding_window_layers(vllm_config, bf16_default, monkeypatch, block_size):
    """Attention.get_kv_cache_spec sizes a sliding-window layer's block from its backend's one-token spec, then the
    runners shape the spec it returns: the layer's page is the compressed page of the engine's block size."""
    vllm_config.cache_config.block_size = block_size
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False  # a GPU's default (the CPU platform's is on)
    asked = []
    customize = TurboQuantAttentionBackend.customize_spec.__func__
    monkeypatch.setattr(TurboQuantAttentionBackend, "customize_spec",
                        classmethod(lambda cls, spec: asked.append(spec) or customize(cls, spec)))
    make_layers(vllm_config, 1)
    make_layers(vllm_config, 1, first=1, per_layer_sliding_window=4096)
    specs = runner_specs(vllm_config)
    one_token = [spec for spec in asked if spec.block_size == 1]
    assert len(one_token) == 1 and type(one_token[0]) is SlidingWindowSpec
    spec = specs["model.layers.1.self_attn.attn"]
    assert type(spec) is TurboQuantSlidingWindowSpec and spec.sliding_window == 4096
    assert spec.block_size == block_size and spec.turboquant_preset == "tq4"
    # same page as the full-attention layers
    assert spec.page_size_bytes == specs["model.layers.0.self_attn.attn"].page_size_bytes
    assert spec.page_size_bytes == tq_spec(block_size=block_size).page_size_bytes
    assert KVCacheSpecRegistry.get_manager_class(spec).__name__ == "SlidingWindowManager"


def window_model(vllm_config, hybrid_manager_disabled):
    """Layers 0, 2 full attention, 1, 3 a window of 8; the engine core's groups of their specs."""
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = hybrid_manager_disabled
    for i in range(4):
        make_layers(vllm_config, 1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, first=i,
                    per_layer_sliding_window=8 if i % 2 else None)
    specs = runner_specs(vllm_config)
    with set_current_vllm_config(vllm_config):
        resolve_layout(vllm_config, [TurboQuantAttentionBackend], specs.values())
        groups = get_kv_cache_groups(vllm_config, dict(specs))
    return specs, groups


def test_a_model_of_windows_and_full_layers_keeps_compressed_pages(vllm_config, bf16_default):
    """vLLM's hybrid manager (its default on GPUs): one group per attention type, every page compressed."""
    specs, groups = window_model(vllm_config, False)
    page = CacheLayout(get_preset("tq4"), HEAD_DIM, KV_HEADS, BLOCK).page_bytes
    assert {type(spec) for spec in specs.values()} == {TurboQuantFullAttentionSpec, TurboQuantSlidingWindowSpec}
    assert {type(g.kv_cache_spec) for g in groups} == {TurboQuantFullAttentionSpec, TurboQuantSlidingWindowSpec}
    assert {g.kv_cache_spec.page_size_bytes for g in groups} == {page}


def test_windows_with_the_hybrid_manager_off_keep_compressed_pages(vllm_config, bf16_default):
    """--disable-hybrid-kv-cache-manager: vLLM promotes sliding-window specs to full attention (replace_as, which
    takes the spec's fields over); the windowed layers must keep their compressed pages and our builder's spec."""
    specs, groups = window_model(vllm_config, True)
    (group,) = groups
    spec = group.kv_cache_spec
    assert isinstance(spec, TurboQuantFullAttentionSpec) and spec.turboquant_preset == "tq4"
    assert spec.sliding_window == 8  # computed as a window, its blocks kept
    assert spec.page_size_bytes == CacheLayout(get_preset("tq4"), HEAD_DIM, KV_HEADS, BLOCK).page_bytes
    kv_spec.check_builder_spec(spec, group.layer_names)


def test_unsupported_layer_variants_are_refused(vllm_config):
    chunked = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
                                        attention_chunk_size=8192)
    refused = pytest.raises(ValueError, match="attention variant.*--attention-backend")
    with set_current_vllm_config(vllm_config), refused:
        customize_attention_spec(TurboQuantAttentionBackend, chunked)
    with pytest.raises(ValueError, match="not a TurboQuant spec"):
        kv_spec.check_builder_spec(chunked, ["model.layers.0.self_attn.attn"])


def test_different_value_head_size_is_refused(vllm_config):
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=192, head_size_v=128, dtype=torch.bfloat16)
    with set_current_vllm_config(vllm_config), pytest.raises(ValueError, match="value head size"):
        customize_attention_spec(TurboQuantAttentionBackend, spec)


def test_spec_survives_vllm_transformations(vllm_config):
    spec = tq_spec("tq3")
    with set_current_vllm_config(vllm_config):
        assert customize_attention_spec(TurboQuantAttentionBackend, spec) == spec  # a runner may shape it twice
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
    assert replace(spec, is_draft=True) == spec  # the runners mark a draft model's layers
    # vLLM's is_kv_cache_spec_uniform catches AssertionError only: layers of several presets are then grouped
    # as UniformTypeKVCacheSpecs (test_layer_presets.test_kv_config_of_mixed_presets_is_exact)
    with pytest.raises(AssertionError):
        TurboQuantFullAttentionSpec.merge([spec, tq_spec("tq4")])
    with pytest.raises(AssertionError):
        TurboQuantFullAttentionSpec.merge([spec, bf16_spec()])


def layer_names(n):
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


def plan(vllm_config, specs, memory, backends=(TurboQuantAttentionBackend,)):
    """What the engine core does with the workers' specs: resolve the layout, group the layers, size the pool."""
    with set_current_vllm_config(vllm_config):
        resolve_layout(vllm_config, backends, specs.values())
        groups = get_kv_cache_groups(vllm_config, dict(specs))
        return get_kv_cache_config_from_groups(vllm_config, groups, memory)


def test_engine_sizes_the_pool_in_compressed_blocks(vllm_config):
    """What the engine core turns into "GPU KV cache size: N tokens", for the same memory."""
    from vllm.config import DeviceConfig, VllmConfig

    names = layer_names(32)
    memory = 8 << 30
    blocks = {}
    for kind, make in (("tq4", lambda: tq_spec("tq4")), ("bf16", bf16_spec)):
        specs = {n: make() for n in names}
        KVCacheSpecRegistry.check_kv_cache_spec_registry(specs)
        engine = VllmConfig(device_config=DeviceConfig(device="cpu"))  # each engine resolves its own layout
        config = plan(engine, specs, memory)
        assert type(config.kv_cache_groups[0].kv_cache_spec) is type(specs[names[0]])
        blocks[kind] = config.num_blocks
    assert blocks["tq4"] == memory // (32 * tq_spec("tq4").page_size_bytes)
    assert blocks["tq4"] / blocks["bf16"] >= 3.7


def test_layouts_we_cannot_read_are_refused(vllm_config, monkeypatch):
    """The engine core resolves one layout from the workers' backends: ours reads block-contiguous pages only."""
    specs = [tq_spec()]
    assert TurboQuantAttentionBackend.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)
    assert all(layout.is_block_contiguous for layout in TurboQuantAttentionBackend.supported_kv_cache_layouts())
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LBNHC")  # vLLM's default preference: tokens outside heads
    with pytest.raises(ValueError, match="VLLM_KV_CACHE_LAYOUT=LBNHC does not satisfy"):
        resolve_layout(vllm_config, [TurboQuantAttentionBackend], specs)
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT")
    assert resolve_layout(vllm_config, [TurboQuantAttentionBackend], specs) is KVCacheLayout.LBHNC
    assert vllm_config.cache_config.kv_cache_layout == "LBHNC"  # what the workers adopt


def test_a_mixed_model_resolves_a_layout_every_backend_reads(vllm_config):
    """bf16 layers run vLLM's FlashAttention (any layout): the intersection is ours, LBNHC stays out."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    layout = resolve_layout(vllm_config, [FlashAttentionBackend, TurboQuantAttentionBackend.for_preset("tq4")],
                            [bf16_spec(), tq_spec("tq4"), tq_spec("k3v2")])
    assert layout in TurboQuantAttentionBackend.supported_kv_cache_layouts()


def runner_caches(vllm_config, layers):
    """What both runners do once the engine core sent the KV-cache config: attention groups from the layers'
    backends and specs, kernel block sizes, builders, the allocation's per-layer views, the views bound to layers."""
    from vllm.v1.worker.utils import (
        AttentionGroup,
        allocate_kv_cache,
        map_kv_caches_to_kernel_blocks,
        prepare_kernel_block_sizes,
    )

    specs = runner_specs(vllm_config)
    config = plan(vllm_config, specs, 1 << 20)
    groups = {}
    for layer in layers:  # init_attn_backend's phase 1
        backend = layer.get_attn_backend()
        key = (backend.full_cls_name(), specs[layer.layer_name])
        groups.setdefault(key, AttentionGroup(backend, [], specs[layer.layer_name], 0)).layer_names.append(
            layer.layer_name)
    groups = list(groups.values())
    with set_current_vllm_config(vllm_config):
        kernel_block_sizes = prepare_kernel_block_sizes(config, [groups])
        assert kernel_block_sizes == [vllm_config.cache_config.block_size]  # never a split of vLLM's block
        for group in groups:
            group.create_metadata_builders(vllm_config, torch.device("cpu"), kernel_block_sizes[0])
            assert group.kernel_block_size is None
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
        caches = allocate_kv_cache(config, torch.device("cpu"), layout, kernel_block_sizes)
    return config, map_kv_caches_to_kernel_blocks(caches, groups)


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_runner_allocation_views_are_the_kernels_pages(vllm_config, bf16_default, monkeypatch, layout):
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", layout)
    layers = make_layers(vllm_config, 3, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM)
    config, caches = runner_caches(vllm_config, layers)
    assert vllm_config.cache_config.kv_cache_layout == layout
    n = config.num_blocks
    expected = CacheLayout(get_preset("tq4"), HEAD_DIM, KV_HEADS, BLOCK)
    assert n == (1 << 20) // (3 * expected.page_bytes)
    storage = None
    for i, layer in enumerate(layers):
        view = caches[layer.layer_name]
        assert view.dtype == torch.uint8
        assert tuple(view.shape) == (n, KV_HEADS, BLOCK, expected.bytes_per_token_per_head)
        pages = pages_of(view)
        assert tuple(pages.shape) == expected.cache_shape(n)
        assert pages.data_ptr() == view.data_ptr() and pages.untyped_storage().data_ptr() == view.untyped_storage(
        ).data_ptr()
        check_cache(pages, expected)  # what the impl checks before every launch
        assert pages.stride(0) == (expected.page_bytes if layout == "LBHNC" else 3 * expected.page_bytes)
        storage = view.untyped_storage() if storage is None else storage
        assert view.untyped_storage().data_ptr() == storage.data_ptr()  # one allocation
        pages.fill_(i + 1)  # a write through the pages
    # ... lands in the allocation, each layer's pages its own bytes, all within the allocation
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    assert raw.numel() == n * 3 * expected.page_bytes
    assert torch.bincount(raw, minlength=4).tolist() == [0] + [n * expected.page_bytes] * 3
    for i, layer in enumerate(layers):  # and where the layout puts it
        pages = pages_of(caches[layer.layer_name])
        b, h = n - 1, KV_HEADS - 1
        start = pages.storage_offset() + b * pages.stride(0) + h * pages.stride(1)
        assert torch.equal(raw[start : start + expected.head_page_bytes],
                           torch.full((expected.head_page_bytes,), i + 1, dtype=torch.uint8))


def test_pages_of_never_copies():
    """A layout we do not accept would need a copy: pages_of refuses it instead of detaching from the cache."""
    lbnhc = torch.zeros(4, 16, 2, 72, dtype=torch.uint8).transpose(1, 2)  # [B, H, N, C] in LBNHC memory order
    with pytest.raises(RuntimeError):
        pages_of(lbnhc)
    flat = torch.zeros(4, 2, 16 * 72, dtype=torch.uint8)
    assert pages_of(flat) is flat
