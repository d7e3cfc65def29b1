"""The impl end to end on one step (runs the Triton kernels; on a CPU through TRITON_INTERPRET): forward stores
the new keys/values and attends with the builder's metadata; compared with the pure-PyTorch reference over the
same compressed pages. A mixed step and a step of decodes only (the store launch also rotates the queries)."""

from __future__ import annotations

import pytest
import torch

from tests.vllm.conftest import cpu_vllm_config, layer_cache, make_builder, make_cam, make_layers
from turboquant_vllm.core.calibration import KeyCalibration, save_calibration
from turboquant_vllm.core.layout import layout_of_cache
from turboquant_vllm.ops import store_kv
from turboquant_vllm.ops.attention.naive import paged_attention_reference
from turboquant_vllm.vllm.impl import pages_of
from turboquant_vllm.vllm.settings import key_statistics, rank_kv_heads

BLOCK = 16
Q_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64


def write_calibration(path, layer_names, kv_heads=KV_HEADS, head_dim=HEAD_DIM, seed=0):
    gen = torch.Generator().manual_seed(seed)
    save_calibration(path, {n: KeyCalibration(torch.randn(kv_heads, head_dim, generator=gen),
                                              torch.rand(kv_heads, head_dim, generator=gen) * 2 + 0.25)
                            for n in layer_names})
    return str(path)


@pytest.mark.matrix(fast=["decodes-tq4-key-calibration", "mixed-k3v2-window+softcap"])
@pytest.mark.parametrize(
    "layer_kwargs, calibrated",
    [({}, False), ({"per_layer_sliding_window": 8, "logits_soft_cap": 30.0}, False), ({}, True)],
    ids=["plain", "window+softcap", "key-calibration"],
)
@pytest.mark.parametrize("preset", ["tq4", "k3v2"])
@pytest.mark.parametrize("step", ["mixed", "decodes"])
def test_step_matches_reference(vllm_config, workspace, bf16_default, monkeypatch, tmp_path, preset, layer_kwargs,
                                calibrated, step):
    monkeypatch.setenv("TURBOQUANT_PRESET", preset)
    if calibrated:
        path = write_calibration(tmp_path / "keys.safetensors", ["model.layers.0.self_attn.attn"])
        monkeypatch.setenv("TURBOQUANT_KEY_CALIBRATION", path)
    gen = torch.Generator().manual_seed(0)
    (layer,) = make_layers(vllm_config, 1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                           **layer_kwargs)
    impl = layer.impl
    impl.process_weights_after_loading(torch.bfloat16)
    assert (impl.key_calibration is not None) == calibrated
    builder = make_builder(vllm_config, [layer.layer_name], kv_heads=KV_HEADS, head_size=HEAD_DIM)

    if step == "mixed":  # decode, decode, chunked-prefill continuation, fresh prefill
        cached, q_lens = [37, 4, 20, 0], [1, 1, 9, 12]
    else:
        cached, q_lens = [37, 4, 20], [1, 1, 1]
    seq_lens = [c + q for c, q in zip(cached, q_lens)]
    blocks_per_seq = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5
    bound = layer_cache(layer, vllm_config, num_blocks)  # what vLLM binds; forward views it as the kernels' pages
    kv_cache = pages_of(bound)
    perm = torch.randperm(num_blocks, generator=gen)[: sum(blocks_per_seq)].to(torch.int32)
    block_table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        block_table[i, :n] = perm[start : start + n]
        start += n

    def slots(seq, positions):
        return torch.tensor([int(block_table[seq, p // BLOCK]) * BLOCK + p % BLOCK for p in positions],
                            dtype=torch.int64)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    # earlier steps filled the cached tokens
    layout = layout_of_cache(impl.preset, HEAD_DIM, tuple(kv_cache.shape))
    ctx_slots = torch.cat([slots(i, range(c)) for i, c in enumerate(cached)])
    n_ctx = ctx_slots.shape[0]
    store_kv(rand(n_ctx, KV_HEADS, HEAD_DIM), rand(n_ctx, KV_HEADS, HEAD_DIM), kv_cache, ctx_slots, layout,
             impl.key_calibration)

    # this step, padded by one token as a CUDA-graph size would; slot_mapping is not padded
    n_real = sum(q_lens)
    n_padded = n_real + 1
    step_slots = torch.cat([slots(i, range(c, s)) for i, (c, s) in enumerate(zip(cached, seq_lens))])
    query = rand(n_padded, Q_HEADS, HEAD_DIM)
    key, value = rand(n_padded, KV_HEADS, HEAD_DIM), rand(n_padded, KV_HEADS, HEAD_DIM)

    cam = make_cam(q_lens, seq_lens, num_actual_tokens=n_padded, block_table=block_table, slot_mapping=step_slots)
    md = builder.build(0, cam)
    assert (md.num_decodes, md.num_prefills) == ((2, 2) if step == "mixed" else (3, 0)) and md.decode_num_splits > 1
    output = torch.full((n_padded, Q_HEADS, HEAD_DIM), float("nan"), dtype=torch.bfloat16)
    # The store launch rotates every query (decodes' and prefills'): no launch of its own.
    import turboquant_vllm.ops.attention.attention as attention_entry

    monkeypatch.setattr(attention_entry, "rotate_queries", None)
    impl.forward(layer, query, key, value, bound, md, output=output)  # stores this step's keys / values first

    expected = paged_attention_reference(
        query[:n_real], kv_cache, layout, block_table, cam.query_start_loc, cam.seq_lens, impl.scale,
        sliding_window=impl.sliding_window, softcap=impl.softcap, key_calibration=impl.key_calibration,
    )
    torch.testing.assert_close(output[:n_real].float(), expected, atol=2e-2, rtol=2e-2)
    # Calibrated keys are stored centered or not, whichever is shorter (a negative norm): both occur here.
    key_norms = kv_cache[:, :, layout.key_norm_offset : layout.value_code_offset].contiguous().view(torch.float32)
    assert ((key_norms < 0).any() and (key_norms > 0).any()) if calibrated else (key_norms >= 0).all()


def test_each_layer_takes_its_own_calibration(vllm_config, monkeypatch, tmp_path):
    names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    path = write_calibration(tmp_path / "keys.safetensors", names)
    monkeypatch.setenv("TURBOQUANT_KEY_CALIBRATION", path)
    layers = make_layers(vllm_config, 3, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM)
    from turboquant_vllm.core.calibration import load_calibration

    saved = load_calibration(path)
    for layer in layers:
        layer.impl.process_weights_after_loading(torch.bfloat16)
        assert torch.equal(layer.impl.key_calibration.mean, saved[layer.layer_name].mean)


def test_calibration_of_another_model_is_refused(vllm_config, monkeypatch, tmp_path):
    monkeypatch.setenv("TURBOQUANT_KEY_CALIBRATION", write_calibration(tmp_path / "a.safetensors", ["other.attn"]))
    (layer,) = make_layers(vllm_config, 1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM)
    with pytest.raises(ValueError, match="no layer 'model.layers.0.self_attn.attn'.*turboquant-vllm calibrate"):
        layer.impl.process_weights_after_loading(torch.bfloat16)
    monkeypatch.delenv("TURBOQUANT_KEY_CALIBRATION")
    path = write_calibration(tmp_path / "b.safetensors", ["model.layers.1.self_attn.attn"], kv_heads=4)
    other_engine = cpu_vllm_config(turboquant_key_calibration=path)
    (layer,) = make_layers(other_engine, 1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, first=1)
    with pytest.raises(ValueError, match="has 4 KV heads of dim 64.*serves 2"):
        layer.impl.process_weights_after_loading(torch.bfloat16)


def test_calibration_is_refused_with_softcap_and_missing_files(vllm_config, monkeypatch, tmp_path):
    monkeypatch.setenv("TURBOQUANT_KEY_CALIBRATION", str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match="does not exist"):
        make_layers(vllm_config, 1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM)
    path = write_calibration(tmp_path / "keys.safetensors", ["model.layers.1.self_attn.attn"])
    monkeypatch.setenv("TURBOQUANT_KEY_CALIBRATION", path)
    with pytest.raises(ValueError, match="soft-cap"):
        make_layers(cpu_vllm_config(), 1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, first=1,
                    logits_soft_cap=30.0)


def test_tensor_parallel_ranks_take_their_heads():
    assert [rank_kv_heads(8, 2, r) for r in range(2)] == [(0, 4), (4, 4)]
    assert [rank_kv_heads(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]  # replicated
    assert rank_kv_heads(4, 1, 0) == (0, 4)


def test_collecting_sums_real_tokens_only(vllm_config, workspace, bf16_default, monkeypatch):
    """turboquant-vllm calibrate's mode: keys of stored tokens (no skipped slot, no padding), queries of real tokens."""
    monkeypatch.setenv("TURBOQUANT_COLLECT_KEY_STATISTICS", "1")
    (layer,) = make_layers(vllm_config, 1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM)
    layer.impl.process_weights_after_loading(torch.bfloat16)
    builder = make_builder(vllm_config, [layer.layer_name], kv_heads=KV_HEADS, head_size=HEAD_DIM)
    kv_cache = layer_cache(layer, vllm_config, 4)
    q, k = torch.randn(12, Q_HEADS, HEAD_DIM), torch.randn(12, KV_HEADS, HEAD_DIM)
    slots = torch.arange(10, dtype=torch.int64)
    slots[4] = -1  # a skipped token
    cam = make_cam([10], [10], num_actual_tokens=10, block_table=torch.tensor([[0]], dtype=torch.int32),
                   slot_mapping=slots)
    out = torch.empty(12, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    # 12 tokens, 10 slots: forward stores the keys of 9
    layer.impl.forward(layer, q.bfloat16(), k.bfloat16(), k.bfloat16(), kv_cache, builder.build(0, cam), output=out)
    stats = key_statistics[layer.layer_name]
    kept = torch.cat([k[:4], k[5:10]]).bfloat16().double()
    assert stats.key_count == 9 and stats.query_count == 10 * Q_HEADS // KV_HEADS
    torch.testing.assert_close(stats.key_sum, kept.sum(0))


def test_profiling_run_without_metadata_zeroes_the_output(vllm_config, bf16_default):
    (layer,) = make_layers(vllm_config, 1)
    out = torch.ones(3, 32, 128, dtype=torch.bfloat16)
    q = torch.zeros(3, 32, 128, dtype=torch.bfloat16)
    layer.impl.forward(layer, q, q[:, :8], q[:, :8], torch.empty(0), None, output=out)  # no cache: nothing stored
    assert not out.any()


def test_loaded_layers_warm_the_kernels_up_once_per_shape(vllm_config, bf16_default, monkeypatch):
    """Weight loading compiles the kernels (ops.warmup) once per layer shape, with the cache's
    block size, the layer's query heads, window and soft-cap."""
    from turboquant_vllm.vllm import impl, settings

    calls = []
    monkeypatch.setattr(impl, "warm_up", lambda layout, dtype, q_heads, device, **kw: calls.append(
        (layout.block_size, layout.num_kv_heads, dtype, q_heads, kw["sliding_window"], kw["softcap"])))
    monkeypatch.setattr(settings, "_logged", set())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    vllm_config.cache_config.block_size = 32
    layers = make_layers(vllm_config, 2, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM)
    layers += make_layers(vllm_config, 1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, first=2,
                          per_layer_sliding_window=8)
    for layer in layers:
        layer.impl._warm_up(torch.float16, torch.device("cpu"))
    assert calls == [(32, KV_HEADS, torch.float16, Q_HEADS, None, None),
                     (32, KV_HEADS, torch.float16, Q_HEADS, 8, None)]


@pytest.mark.parametrize("invariant", [False, True])
def test_batch_invariant_mode_warms_up_only_the_kernels_it_runs(vllm_config, bf16_default, monkeypatch, invariant):
    """VLLM_BATCH_INVARIANT=1 runs every row through the general kernel at one split, without the dense path: the
    warm-up then compiles no decode kernel and no context expansion."""
    from turboquant_vllm.vllm import compat, impl, settings

    kwargs = []
    monkeypatch.setattr(impl, "warm_up", lambda *a, **kw: kwargs.append(kw))
    monkeypatch.setattr(compat, "batch_invariant", lambda: invariant)
    monkeypatch.setattr(compat, "flash_attn_varlen", lambda: (object(), 3))
    monkeypatch.setattr(settings, "_logged", set())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    (layer,) = make_layers(vllm_config, 1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM)
    layer.impl._warm_up(torch.bfloat16, torch.device("cpu"))
    (kw,) = kwargs
    assert kw["dense_prefill"] == (not invariant)
    assert (list(kw["decode_batches"]) == []) == invariant


@pytest.mark.parametrize("preset", ["tq4", "k5v4"])
def test_batch_invariant_rows_equal_whatever_the_step(vllm_config, workspace, bf16_default, monkeypatch, preset):
    """VLLM_BATCH_INVARIANT=1: a row decoded alone, decoded beside another request, or verified as the last of four
    speculative tokens is the same to the bit (one kernel at one split, queries rotated apart from the store)."""
    from turboquant_vllm.vllm import compat

    monkeypatch.setenv("TURBOQUANT_PRESET", preset)
    monkeypatch.setattr(compat, "batch_invariant", lambda: True)
    (layer,) = make_layers(vllm_config, 1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM)
    impl = layer.impl
    impl.process_weights_after_loading(torch.bfloat16)
    builder = make_builder(vllm_config, [layer.layer_name], kv_heads=KV_HEADS, head_size=HEAD_DIM)
    assert builder.batch_invariant and not builder.dense_prefill
    gen = torch.Generator().manual_seed(1)
    lens = [41, 11]  # request 0's last token at 40, request 1's at 10
    keys = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16) for n in lens]
    values = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16) for n in lens]
    queries = [torch.randn(n, Q_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16) for n in lens]
    block_table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)

    def step(parts):
        """One forward over fresh pages: parts = [(request, first new position)], the earlier positions stored
        before; returns each part's last row."""
        bound = layer_cache(layer, vllm_config, 6)
        kv_cache = pages_of(bound)
        layout = layout_of_cache(impl.preset, HEAD_DIM, tuple(kv_cache.shape))
        slot = lambda r, p: int(block_table[r, p // BLOCK]) * BLOCK + p % BLOCK  # noqa: E731
        for r, first in parts:
            store_kv(keys[r][:first], values[r][:first], kv_cache,
                     torch.tensor([slot(r, p) for p in range(first)], dtype=torch.int64), layout)
        take = lambda t: torch.cat([t[r][first:] for r, first in parts])  # noqa: E731
        q_lens = [lens[r] - first for r, first in parts]
        slots = torch.tensor([slot(r, p) for r, first in parts for p in range(first, lens[r])], dtype=torch.int64)
        cam = make_cam(q_lens, [lens[r] for r, _ in parts], block_table=block_table[[r for r, _ in parts]],
                       slot_mapping=slots)
        md = builder.build(0, cam)
        assert md.batch_invariant and md.decode_num_splits == 1 and md.prefill_cu_seqlens_k is None
        output = torch.full((sum(q_lens), Q_HEADS, HEAD_DIM), float("nan"), dtype=torch.bfloat16)
        impl.forward(layer, take(queries), take(keys), take(values), bound, md, output=output)
        assert not output.isnan().any()
        ends = torch.tensor(q_lens).cumsum(0) - 1
        return output[ends]

    alone = step([(0, 40)])[0]
    beside = step([(0, 40), (1, 10)])[0]
    verified = step([(1, 10), (0, 37)])[1]  # a decode first, then request 0 verifying positions 37 .. 40
    assert torch.equal(alone, beside) and torch.equal(alone, verified)
