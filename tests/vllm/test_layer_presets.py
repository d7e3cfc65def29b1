"""Per-layer presets (TURBOQUANT_LAYER_PRESETS / --additional-config turboquant_layer_presets): parsed and checked;
each layer bound to its preset once the model is built, bf16 layers becoming vLLM FlashAttention layers; vLLM's own
KV-cache planning gives every layer exactly its own page; the runners' allocation gives each layer a view of its own
page (a TurboQuant layer's, its preset's pages); a TurboQuant layer attends over its own preset; each preset in use
is warmed up."""

from __future__ import annotations

import types

import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.utils.math_utils import round_up
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl
from vllm.v1.core.kv_cache_planning import (
    get_global_kv_cache_groups,
    get_kv_cache_config_from_groups,
    get_kv_cache_configs,
    get_kv_cache_groups,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec, UniformTypeKVCacheSpecs

from tests.vllm.conftest import FakeVllmConfig, layer_cache, make_cam, make_layers, resolve_layout, workspace_bytes
from tests.vllm.test_backend import validate
from turboquant_vllm.core.layout import CacheLayout, cache_layout, layout_of_cache
from turboquant_vllm.core.presets import get_preset
from turboquant_vllm.ops import store_kv
from turboquant_vllm.ops.attention import num_sms
from turboquant_vllm.ops.attention.naive import paged_attention_reference
from turboquant_vllm.ops.utils import check_cache
from turboquant_vllm.vllm import compat, impl, kv_spec, settings
from turboquant_vllm.vllm.backend import TurboQuantAttentionBackend
from turboquant_vllm.vllm.impl import TurboQuantAttentionImpl, pages_of
from turboquant_vllm.vllm.kv_spec import TurboQuantFullAttentionSpec
from turboquant_vllm.vllm.metadata import TurboQuantMetadataBuilder, max_workspace_elems
from turboquant_vllm.vllm.settings import (
    LAYER_PRESETS_CONFIG_KEY,
    LAYER_PRESETS_ENV,
    describe_layer_presets,
    parse_layer_presets,
    resolve_settings,
)

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 4, 2, 64, 16, 4
MIXED = "0,-1=bf16;1=k4v3"  # layer 2 keeps the preset (tq4)
BF16_PAGE = BLOCK * KV_HEADS * 2 * HEAD_DIM * 2


def config_with(value):
    return {LAYER_PRESETS_CONFIG_KEY: value}


def layer_presets_of(additional_config):
    return resolve_settings(additional_config).layer_presets


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------
def test_env_and_config_forms_give_the_same_presets(monkeypatch):
    expected = {0: "bf16", 1: "bf16", 28: "bf16", 29: "bf16", 5: "k4v3", 6: "k4v3", 7: "k4v3"}
    from_config = layer_presets_of(config_with({"0,1,28,29": "bf16", "5-7": "k4v3"}))
    assert from_config.resolve(30) == expected and LAYER_PRESETS_CONFIG_KEY in from_config.source
    monkeypatch.setenv(LAYER_PRESETS_ENV, " 0, 1,28,29 = BF16 ; 5-7=k4v3 ;")
    from_env = layer_presets_of(None)
    assert from_env.resolve(30) == expected and from_env.source == LAYER_PRESETS_ENV


def test_negative_indices_and_ranges_count_from_the_end():
    presets = parse_layer_presets("-2,-1=bf16;0=k4v3;3--3=tq3", LAYER_PRESETS_ENV)
    assert presets.resolve(8) == {6: "bf16", 7: "bf16", 0: "k4v3", 3: "tq3", 4: "tq3", 5: "tq3"}
    assert presets.turboquant_presets() == {get_preset("k4v3"), get_preset("tq3")}


def test_nothing_given_is_no_layer_presets(monkeypatch):
    assert layer_presets_of(None) is None
    assert layer_presets_of(config_with({})) is None
    monkeypatch.setenv(LAYER_PRESETS_ENV, " ; ")
    assert layer_presets_of(None) is None


def test_given_both_ways_they_must_agree(monkeypatch):
    monkeypatch.setenv(LAYER_PRESETS_ENV, "0=bf16;5-7=k4v3")
    assert layer_presets_of(config_with({"5-7": "K4V3", "0": "bf16"})).resolve(8)[6] == "k4v3"  # any order
    with pytest.raises(ValueError, match="given twice.*keep one of them"):
        layer_presets_of(config_with({"0": "bf16"}))


@pytest.mark.parametrize(
    "text, needle",
    [("0=tq9", "unknown preset 'tq9' for layers 0; choose bf16 or one of tq4"), ("x=bf16", "not a list of layer"),
     ("1..3=bf16", "not a list of layer"), ("0,1", "not LAYERS=PRESET")],
)
def test_malformed_entries_are_refused(monkeypatch, text, needle):
    monkeypatch.setenv(LAYER_PRESETS_ENV, text)
    with pytest.raises(ValueError, match=f"^{LAYER_PRESETS_ENV}: .*{needle}"):
        layer_presets_of(None)


def test_config_value_must_be_an_object():
    with pytest.raises(ValueError, match="expected a JSON object"):
        layer_presets_of(config_with(["0", "bf16"]))


@pytest.mark.parametrize(
    "text, needle",
    [("30=bf16", "reach past the model's 30 layers"), ("-31=bf16", "reach past"), ("28-30=tq3", "reach past"),
     ("5-2=bf16", "empty"), ("0-3=bf16;3=tq3", "layer 3 is in two entries"),
     ("-1=bf16;29=tq3", "layer 29 is in two entries")],
)
def test_layers_are_checked_against_the_model(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_layer_presets(text, LAYER_PRESETS_ENV).resolve(30)


def test_a_preset_the_head_size_cannot_take_is_refused():
    presets = parse_layer_presets("5-7=k5v4", LAYER_PRESETS_ENV)
    presets.check(128, 30)
    presets.check(64, 30)
    with pytest.raises(ValueError,
                       match="layers 5-7 preset k5v4.*multiple of 16 in \\[32, 256\\], got 72.*another preset"):
        presets.check(72, 30)


@pytest.mark.parametrize(
    "value, head_size, needle",
    [({"0": "tq0"}, 128, "unknown preset 'tq0'"), ({"40": "bf16"}, 128, "reach past the model's 32 layers")],
)
def test_the_backend_selector_refuses_bad_layer_presets(monkeypatch, value, head_size, needle):
    cfg = FakeVllmConfig(additional_config=config_with(value),
                         model_config=types.SimpleNamespace(get_total_num_hidden_layers=lambda: 32))
    monkeypatch.setattr(compat, "current_vllm_config", lambda: cfg)
    reasons = validate(head_size=head_size)
    assert any(needle in r and LAYER_PRESETS_CONFIG_KEY in r for r in reasons), reasons


def test_startup_line():
    line = describe_layer_presets([(3, "bf16", 8, 128), (0, "bf16", 8, 128), (1, "k4v3", 8, 128), (2, "tq4", 8, 128)])
    # bf16 8 x 512 B per token per layer; tq4 8 x 136, k4v3 8 x 120
    assert line == ("TurboQuant KV cache per layer: bf16 0,3; k4v3 1; tq4 2: 10,240 B per token over 4 layers vs "
                    "16,384 B in bf16 -> 1.60x KV-cache capacity")
    assert "tq4 0-2,5,28-29:" in describe_layer_presets([(i, "tq4", 1, 128) for i in (0, 1, 2, 5, 28, 29)])


# ---------------------------------------------------------------------------------------------
# The model: layers bound to their presets
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def model(vllm_config, bf16_default, monkeypatch):
    """A model of LAYERS layers (the layers themselves come from build) on a machine where FlashAttention runs."""
    vllm_config.model_config = types.SimpleNamespace(
        dtype=torch.bfloat16, is_mm_prefix_lm=False, use_mla=False, max_model_len=1024, original_max_model_len=1024,
        get_total_num_hidden_layers=lambda: LAYERS, supports_kv_cache_grouping=False,
    )
    monkeypatch.setattr(compat, "flash_attn_varlen", lambda: (None, 2))
    return vllm_config


def build(vllm_config, n=LAYERS, **kwargs):
    """n layers as the model builds them, then weight loading's process_weights_after_loading (CPU: no warm-up)."""
    layers = make_layers(vllm_config, n, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, **kwargs)
    for layer in layers:
        layer.process_weights_after_loading(torch.bfloat16)
    return layers


def layout_of(preset):
    return CacheLayout(get_preset(preset), HEAD_DIM, KV_HEADS, BLOCK)


def specs_of(layers, vllm_config):
    """Each layer's spec as the runners collect it: the layer's, through its backend's customize_spec."""
    from vllm.v1.worker.utils import customize_attention_spec

    with set_current_vllm_config(vllm_config):
        return {layer.layer_name: customize_attention_spec(layer.get_attn_backend(),
                                                           layer.get_kv_cache_spec(vllm_config))
                for layer in layers}


def engine_kv_cache_config(vllm_config, layers, specs, memory):
    """What the engine core runs on the workers' specs: the layout every layer's backend reads, the groups, the
    pool (get_kv_cache_configs)."""
    with set_current_vllm_config(vllm_config):
        resolve_layout(vllm_config, {layer.get_attn_backend() for layer in layers}, specs.values())
        groups = get_global_kv_cache_groups(vllm_config, [dict(specs)])
        (config,) = get_kv_cache_configs(vllm_config, [dict(specs)], [memory], groups)
    return config


def test_each_layer_is_bound_to_its_preset(model, monkeypatch):
    monkeypatch.setenv(LAYER_PRESETS_ENV, MIXED)
    lines = []
    monkeypatch.setattr(settings, "_logged", set())
    monkeypatch.setattr(settings.logger, "info", lambda fmt, *args: lines.append(fmt % args))
    layers = build(model)
    for layer in (layers[0], layers[3]):  # bf16: a vLLM FlashAttention layer
        backend = layer.get_attn_backend()
        assert isinstance(layer.impl, FlashAttentionImpl) and issubclass(backend, FlashAttentionBackend)
        assert backend.get_name() == "FLASH_ATTN"
        assert layer.impl.sliding_window == (-1, -1) and layer.impl.scale == HEAD_DIM**-0.5
        spec = specs_of([layer], model)[layer.layer_name]
        assert type(spec) is FullAttentionSpec and spec.dtype == torch.bfloat16 and spec.page_size_bytes == BF16_PAGE
    for layer, name in ((layers[1], "k4v3"), (layers[2], "tq4")):
        backend = layer.get_attn_backend()
        assert issubclass(backend, TurboQuantAttentionBackend) and backend.preset_name == name
        assert backend.get_name() == "CUSTOM"
        assert isinstance(layer.impl, TurboQuantAttentionImpl) and layer.impl.layout == layout_of(name)
        spec = specs_of([layer], model)[layer.layer_name]
        assert type(spec) is TurboQuantFullAttentionSpec and spec.turboquant_preset == name
        assert spec.page_size_bytes == layout_of(name).page_bytes
        # the runner's [blocks, heads, block_size, C] view of 10 blocks, merged, is the preset's pages
        assert (10, spec.num_heads, spec.num_states * spec.state_content_size_bytes) == layout_of(name).cache_shape(10)
    assert layers[1].get_attn_backend().full_cls_name() != layers[2].get_attn_backend().full_cls_name()
    # Every layer stores in forward: Attention.forward traces alike whatever the layer's preset.
    assert all(layer.get_attn_backend().forward_includes_kv_cache_update for layer in layers)
    # one line, once the layers are bound; no per-preset line at construction
    assert lines == [describe_layer_presets([(i, p, KV_HEADS, HEAD_DIM) for i, p in
                                             enumerate(["bf16", "k4v3", "tq4", "bf16"])])]
    assert "bf16 0,3; k4v3 1; tq4 2:" in lines[0]


def test_without_layer_presets_every_layer_takes_the_preset(model, monkeypatch):
    monkeypatch.setenv("TURBOQUANT_PRESET", "tq3")
    layers = build(model)
    assert {layer.get_attn_backend().preset_name for layer in layers} == {"tq3"}
    specs = specs_of(layers, model)
    with set_current_vllm_config(model):
        resolve_layout(model, [TurboQuantAttentionBackend.for_preset("tq3")], specs.values())
        (group,) = get_kv_cache_groups(model, specs)
    assert type(group.kv_cache_spec) is TurboQuantFullAttentionSpec  # vLLM's uniform path, as before


@pytest.mark.parametrize("value, needle", [("4=bf16", "reach past the model's 4 layers"),
                                           ("1=tq9", "unknown preset 'tq9'")])
def test_bad_layer_presets_fail_before_the_weights_load(model, monkeypatch, value, needle):
    monkeypatch.setenv(LAYER_PRESETS_ENV, value)
    with pytest.raises(ValueError, match=needle):
        build(model, 1)


def test_bf16_layers_need_flash_attention(model, monkeypatch):
    monkeypatch.setattr(compat, "flash_attn_varlen", lambda: None)  # no GPU, no FlashAttention build
    monkeypatch.setenv(LAYER_PRESETS_ENV, "0=bf16")
    with pytest.raises(ValueError, match="bf16 layers run vLLM's FlashAttention.*TurboQuant preset"):
        build(model)


def test_kv_sharing_layers_take_their_targets_preset(model, monkeypatch):
    monkeypatch.setenv(LAYER_PRESETS_ENV, "0=bf16")
    target = "model.layers.0.self_attn.attn"
    layers = make_layers(model, 1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM)
    layers += make_layers(model, 1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, first=1,
                          kv_sharing_target_layer_name=target)
    layers[1].process_weights_after_loading(torch.bfloat16)
    assert isinstance(layers[1].impl, FlashAttentionImpl) and layers[1].impl.kv_sharing_target_layer_name == target


def test_kv_sharing_layers_cannot_take_another_preset(model, monkeypatch):
    monkeypatch.setenv(LAYER_PRESETS_ENV, "0=bf16;1=tq3")
    make_layers(model, 1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM)
    (sharing,) = make_layers(model, 1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, first=1,
                             kv_sharing_target_layer_name="model.layers.0.self_attn.attn")
    with pytest.raises(ValueError, match="KV sharing.*preset is bf16, not tq3"):
        sharing.process_weights_after_loading(torch.bfloat16)


def test_layer_index_is_vllms(model):
    assert kv_spec.layer_index("language_model.model.layers.28.self_attn.attn", "X") == 28
    with pytest.raises(ValueError, match="cannot tell the layer index.*without per-layer presets"):
        kv_spec.layer_index("model.layers.3.block.1.attn", "X")


# ---------------------------------------------------------------------------------------------
# Memory: exactly each layer's page, through vLLM's own KV-cache config and runner code
# ---------------------------------------------------------------------------------------------
def spec_of(preset, heads=8, head_size=128):
    if preset == "bf16":
        return FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16)
    return TurboQuantFullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head_size, dtype=torch.uint8,
                                       turboquant_preset=preset)


def assert_exact(config, specs, memory, layout):
    """One group of per-layer specs; num_blocks = memory // (sum of the pages); one allocation in which each layer
    takes num_blocks x its own page, unpadded."""
    (group,) = config.kv_cache_groups
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs) and sorted(group.layer_names) == sorted(specs)
    per_block = sum(spec.page_size_bytes for spec in specs.values())
    assert config.num_blocks == memory // per_block
    assert sorted(name for tensor in config.kv_cache_tensors for name in tensor.layers) == sorted(specs)
    (size,) = {tensor.size for tensor in config.kv_cache_tensors}  # the one backing allocation
    assert size == config.num_blocks * per_block and 0 <= memory - size < per_block
    for tensor in config.kv_cache_tensors:  # the layers of one spec
        (page,) = {specs[name].page_size_bytes for name in tensor.layers}
        if layout.is_block_outermost:  # a block holds every layer's page
            assert (tensor.block_stride, tensor.layer_stride) == (per_block, page)
        else:  # a layer holds its pages of every block
            assert (tensor.block_stride, tensor.layer_stride) == (page, config.num_blocks * page)
    # padding every layer to the largest page would hold fewer blocks
    largest = max(spec.page_size_bytes for spec in specs.values())
    assert config.num_blocks >= memory // (largest * len(specs))


@pytest.mark.parametrize(
    "presets",
    [["bf16", "tq4", "k4v3", "tq3", "tq4", "k3v2", "tq2", "k5v4", "bf16"], ["tq4", "k4v3", "tq4"], ["bf16", "tq3"]],
)
@pytest.mark.parametrize("kv_cache_layout", ["LBHNC", "BLHNC"])
def test_kv_config_of_mixed_presets_is_exact(vllm_config, monkeypatch, presets, kv_cache_layout):
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", kv_cache_layout)
    specs = {f"model.layers.{i}.self_attn.attn": spec_of(p) for i, p in enumerate(presets)}
    memory = (256 << 20) + 12345
    with set_current_vllm_config(vllm_config):
        # bf16 layers run vLLM's FlashAttention; the layers of mixed pages need a block-compact layout: ours are
        layout = resolve_layout(vllm_config, [FlashAttentionBackend, TurboQuantAttentionBackend.for_preset("tq4")],
                                specs.values())
        groups = get_kv_cache_groups(vllm_config, dict(specs))
        config = get_kv_cache_config_from_groups(vllm_config, groups, memory)
    assert layout.name == kv_cache_layout
    assert_exact(config, specs, memory, layout)


def test_engine_kv_config_of_a_bound_model_is_exact(model, monkeypatch):
    """What the engine core runs on the workers' specs (get_kv_cache_configs), for layers bound to MIXED."""
    monkeypatch.setenv(LAYER_PRESETS_ENV, MIXED)
    layers = build(model)
    specs = specs_of(layers, model)
    assert [spec.page_size_bytes for spec in specs.values()] == [
        BF16_PAGE, layout_of("k4v3").page_bytes, layout_of("tq4").page_bytes, BF16_PAGE]
    memory = (64 << 20) + 999
    config = engine_kv_cache_config(model, layers, specs, memory)
    assert_exact(config, specs, memory, model.cache_config.get_resolved_kv_cache_layout())


def attention_groups(layers, specs):
    """What both runners build from a KV-cache group: one attention group per (backend, layer spec, query heads)."""
    from vllm.v1.worker.utils import AttentionGroup

    groups = {}
    for layer in layers:
        backend, spec = layer.get_attn_backend(), specs[layer.layer_name]
        key = (backend.full_cls_name(), spec, layer.num_heads)
        groups.setdefault(key, AttentionGroup(backend, [], spec, 0)).layer_names.append(layer.layer_name)
    return list(groups.values())


@pytest.mark.parametrize("kv_cache_layout", ["LBHNC", "BLHNC"])
def test_runners_give_each_layer_a_view_of_its_own_pages(model, monkeypatch, kv_cache_layout):
    """Both runners: allocate_kv_cache's per-layer views (bound after map_kv_caches_to_kernel_blocks); each
    TurboQuant layer's view, merged by impl.pages_of, is its preset's pages, inside the one allocation."""
    from vllm.v1.worker.utils import allocate_kv_cache, map_kv_caches_to_kernel_blocks, prepare_kernel_block_sizes

    monkeypatch.setenv(LAYER_PRESETS_ENV, MIXED)
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", kv_cache_layout)
    layers = build(model)
    specs = specs_of(layers, model)
    config = engine_kv_cache_config(model, layers, specs, 8 << 20)
    layout = model.cache_config.get_resolved_kv_cache_layout()
    assert layout.name == kv_cache_layout
    with set_current_vllm_config(model):
        groups = attention_groups(layers, config.kv_cache_groups[0].kv_cache_spec.kv_cache_specs)
        assert len(groups) == 3  # FlashAttention (layers 0, 3), k4v3, tq4
        kernel_block_sizes = prepare_kernel_block_sizes(config, [groups])
        assert kernel_block_sizes == [BLOCK]
        caches = map_kv_caches_to_kernel_blocks(allocate_kv_cache(config, torch.device("cpu"), layout,
                                                                  kernel_block_sizes), groups)
    n = config.num_blocks
    per_block = sum(spec.page_size_bytes for spec in specs.values())
    storage = {cache.untyped_storage().data_ptr() for cache in caches.values()}
    assert len(storage) == 1 and caches[layers[0].layer_name].untyped_storage().nbytes() == n * per_block
    for layer, preset in zip(layers, ["bf16", "k4v3", "tq4", "bf16"]):
        cache = caches[layer.layer_name]
        if preset == "bf16":  # FlashAttention's [blocks, heads, block_size, K|V]
            assert cache.dtype == torch.bfloat16 and tuple(cache.shape) == (n, KV_HEADS, BLOCK, 2 * HEAD_DIM)
            continue
        pages = pages_of(cache)
        assert cache.dtype == torch.uint8 and tuple(pages.shape) == layout_of(preset).cache_shape(n)
        assert pages.data_ptr() == cache.data_ptr()  # a view: the kernels' stores land in the allocation
        check_cache(pages, layout_of(preset))
        assert pages.stride(0) == (per_block if layout.is_block_outermost else layout_of(preset).page_bytes)


def test_sliding_window_layers_need_one_kv_cache_group(model, monkeypatch):
    monkeypatch.setenv(LAYER_PRESETS_ENV, "1=bf16")
    model.scheduler_config.disable_hybrid_kv_cache_manager = False  # vLLM's default on GPUs
    make_layers(model, 1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM)
    (sliding,) = make_layers(model, 1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, first=1,
                             per_layer_sliding_window=8)
    with pytest.raises(ValueError, match="mixes sliding-window and full.*--disable-hybrid-kv-cache-manager"):
        sliding.process_weights_after_loading(torch.bfloat16)


def test_sliding_window_layers_with_the_hybrid_manager_off(model, monkeypatch):
    """All layers in one group: vLLM computes the windows, keeps every block; bf16 sliding-window layers take the
    group's block size (vLLM would give them its smallest kernel block)."""
    monkeypatch.setenv(LAYER_PRESETS_ENV, "1=bf16")
    model.scheduler_config.disable_hybrid_kv_cache_manager = True
    model.cache_config.block_size = 32
    layers = [layer for i in range(LAYERS) for layer in build(model, 1, first=i, per_layer_sliding_window=(
        8 if i % 2 else None))]
    specs = specs_of(layers, model)
    assert type(specs[layers[1].layer_name]) is SlidingWindowSpec and specs[layers[1].layer_name].block_size == 32
    assert specs[layers[3].layer_name].sliding_window == 8 and specs[layers[3].layer_name].turboquant_preset == "tq4"
    memory = (32 << 20) + 5
    config = engine_kv_cache_config(model, layers, specs, memory)
    kept = config.kv_cache_groups[0].kv_cache_spec.kv_cache_specs
    assert isinstance(kept[layers[3].layer_name], TurboQuantFullAttentionSpec)  # full attention, compressed pages
    assert kept[layers[3].layer_name].page_size_bytes == cache_layout(get_preset("tq4"), HEAD_DIM, KV_HEADS,
                                                                      32).page_bytes
    assert_exact(config, kept, memory, model.cache_config.get_resolved_kv_cache_layout())


# ---------------------------------------------------------------------------------------------
# Serving: a TurboQuant layer of a mixed model attends over its own preset; every preset is warmed up
# ---------------------------------------------------------------------------------------------
def test_a_turboquant_layer_attends_over_its_own_preset(model, workspace, monkeypatch):
    monkeypatch.setenv(LAYER_PRESETS_ENV, MIXED)
    layer = build(model)[1]
    spec = specs_of([layer], model)[layer.layer_name]
    builder = TurboQuantMetadataBuilder(spec, [layer.layer_name], model, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    cached, seq_lens = [20, 37, 5], [21, 38, 6]  # a step of three decodes
    block_table = torch.arange(9, dtype=torch.int32).view(3, 3)
    bound = layer_cache(layer, model, 9)  # what vLLM binds; forward views it as the layer's preset's pages
    kv_cache = pages_of(bound)
    layout = layout_of_cache(layer.impl.preset, HEAD_DIM, tuple(kv_cache.shape))
    assert layout == layout_of("k4v3") == builder.layout

    def slots(seq, positions):
        return torch.tensor([int(block_table[seq, p // BLOCK]) * BLOCK + p % BLOCK for p in positions])

    def rand(n, heads):
        return torch.randn(n, heads, HEAD_DIM, generator=gen).to(torch.bfloat16)

    context = torch.cat([slots(i, range(c)) for i, c in enumerate(cached)])
    store_kv(rand(len(context), KV_HEADS), rand(len(context), KV_HEADS), kv_cache, context, layout)
    step = torch.cat([slots(i, [c]) for i, c in enumerate(cached)])
    query, key, value = rand(3, Q_HEADS), rand(3, KV_HEADS), rand(3, KV_HEADS)
    cam = make_cam([1, 1, 1], seq_lens, block_table=block_table, slot_mapping=step)
    output = torch.full((3, Q_HEADS, HEAD_DIM), float("nan"), dtype=torch.bfloat16)
    layer.impl.forward(layer, query, key, value, bound, builder.build(0, cam), output=output)
    expected = paged_attention_reference(query, kv_cache, layout, block_table, cam.query_start_loc, cam.seq_lens,
                                         layer.impl.scale)
    torch.testing.assert_close(output.float(), expected, atol=2e-2, rtol=2e-2)


def test_a_bf16_layer_stores_then_runs_flash_attention(model, monkeypatch):
    monkeypatch.setenv(LAYER_PRESETS_ENV, MIXED)
    layer = build(model)[0]
    calls = []
    monkeypatch.setattr(FlashAttentionImpl, "do_kv_cache_update",
                        lambda self, layer, key, value, kv_cache, slots: calls.append(("store", slots)))
    monkeypatch.setattr(FlashAttentionImpl, "forward", lambda self, layer, q, k, v, kv_cache, md, output, *scales:
                        calls.append(("attend", md)) or output)
    q, k = torch.zeros(3, Q_HEADS, HEAD_DIM), torch.zeros(3, KV_HEADS, HEAD_DIM)
    md = types.SimpleNamespace(slot_mapping=torch.arange(2))  # not padded, unlike the keys
    out = torch.empty_like(q)
    assert layer.impl.forward(layer, q, k, k, torch.empty(0), md, output=out) is out
    assert calls == [("store", md.slot_mapping), ("attend", md)]
    calls.clear()
    layer.impl.forward(layer, q, k, k, torch.empty(0), None, output=out)  # memory profiling: nothing stored
    assert calls == [("attend", None)]


def test_weight_loading_warms_up_every_preset_in_use(model, monkeypatch):
    """On a GPU, process_weights_after_loading compiles the kernels of each layer's own preset, once per shape; bf16
    layers compile nothing (vLLM's FlashAttention is built ahead of time)."""
    monkeypatch.setenv(LAYER_PRESETS_ENV, "0=bf16;1=k4v3;3=k4v3")  # layer 2: tq4
    layers = make_layers(model, LAYERS, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM)
    warmed, tables = [], []
    monkeypatch.setattr(settings, "_logged", set())
    monkeypatch.setattr(impl, "warm_up", lambda layout, dtype, q_heads, device, **kw: warmed.append(layout.preset.name))
    monkeypatch.setattr(impl, "kernel_constants", lambda layout, device: tables.append(layout.preset.name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    for layer in layers:
        layer.process_weights_after_loading(torch.bfloat16)
    assert sorted(warmed) == ["k4v3", "tq4"]
    assert tables == ["k4v3", "tq4", "k4v3"]


def test_workspace_covers_every_preset_in_use(vllm_config, workspace, bf16_default, monkeypatch):
    monkeypatch.setenv(LAYER_PRESETS_ENV, "0=k5v4")  # the general kernel's decode splits differ from tq4's
    make_layers(vllm_config, 2)
    sched = vllm_config.scheduler_config
    max_tokens = max(sched.max_num_batched_tokens, vllm_config.compilation_config.max_cudagraph_capture_size or 0)
    elems = max(max_workspace_elems(32, cache_layout(get_preset(p), 128, 8, BLOCK), max_tokens, sched.max_num_seqs,
                                    num_sms()) for p in ("tq4", "k5v4"))
    assert workspace_bytes(workspace) == round_up(elems * 4, 256)
