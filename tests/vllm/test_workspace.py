"""Split-KV scratch: one shared buffer from vLLM's workspace manager, reserved at its maximum when
the first layer is built; more layers, builders and steps add nothing."""

from __future__ import annotations

import pytest
import torch
from vllm.utils.math_utils import round_up

from tests.vllm.conftest import make_builder, make_cam, make_layers, workspace_bytes
from turboquant_vllm.core.layout import cache_layout
from turboquant_vllm.core.presets import DEFAULT_PRESET, get_preset
from turboquant_vllm.ops.attention import attention_workspace_shape, decode_launch, decode_num_splits, split_count
from turboquant_vllm.vllm.metadata import max_workspace_elems, workspace_elems


def test_more_layers_add_no_scratch(vllm_config, workspace, bf16_default):
    assert workspace_bytes(workspace) == 0
    make_layers(vllm_config, 1)
    reserved = workspace_bytes(workspace)
    sched = vllm_config.scheduler_config
    max_tokens = max(sched.max_num_batched_tokens, vllm_config.compilation_config.max_cudagraph_capture_size or 0)
    layout = cache_layout(get_preset(DEFAULT_PRESET), 128, 8, 16)
    elems = max_workspace_elems(32, layout, max_tokens, sched.max_num_seqs, 132)
    assert reserved == round_up(elems * 4, 256) > 0
    make_layers(vllm_config, 31, first=1)
    assert workspace_bytes(workspace) == reserved
    builder = make_builder(vllm_config, [f"model.layers.{i}.self_attn.attn" for i in range(32)])
    assert workspace_bytes(workspace) == reserved
    assert builder.workspace_elems == elems


@pytest.mark.parametrize("preset", ["tq4", "k5v4"])  # the two decode kernels split differently
def test_reservation_covers_every_step(vllm_config, preset):
    sched = vllm_config.scheduler_config
    q_heads, kv_heads, d, sms = 32, 8, 128, 132
    p = get_preset(preset)
    most = max_workspace_elems(q_heads, cache_layout(p, d, kv_heads, 16), sched.max_num_batched_tokens,
                               sched.max_num_seqs, sms)
    assert most >= attention_workspace_shape(sched.max_num_batched_tokens, q_heads, d, 1)[0]
    for seqs in range(1, sched.max_num_seqs + 1):
        launch = decode_launch(p, d)
        splits = split_count(seqs, kv_heads, sms, launch.programs_per_sm, launch.max_splits)
        assert most >= attention_workspace_shape(seqs, q_heads, d, splits)[0]
        # a mixed step: seqs decodes, the rest of the token budget as prefill
        assert most >= workspace_elems(seqs, sched.max_num_batched_tokens - seqs, splits, q_heads, d)


def test_steps_take_views_of_the_shared_buffer(vllm_config, workspace, bf16_default):
    from vllm.v1.worker.workspace import lock_workspace

    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    make_layers(vllm_config, 2)
    reserved = workspace_bytes(workspace)
    builder = make_builder(vllm_config, names)
    lock_workspace()  # as the V1 runner does after CUDA-graph capture: no growth allowed any more
    max_seqs = vllm_config.scheduler_config.max_num_seqs
    max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    base = workspace._current_workspaces[0].untyped_storage().data_ptr()
    for q_lens in ([1] * max_seqs, [max_tokens], [1] * 7 + [max_tokens - 7], [1]):
        md = builder.build(0, make_cam(q_lens, [q + 100 for q in q_lens]))
        assert md.workspace.dtype == torch.float32
        assert md.workspace.untyped_storage().data_ptr() == base
    assert workspace_bytes(workspace) == reserved


def test_no_workspace_manager_no_reservation(vllm_config, bf16_default):
    from vllm.v1.worker.workspace import is_workspace_manager_initialized

    assert not is_workspace_manager_initialized()
    make_layers(vllm_config, 1)  # unit-test setting: nothing to reserve, nothing fails
    builder = make_builder(vllm_config, ["model.layers.0.self_attn.attn"])
    assert builder.workspace_elems is None
    assert builder.build(0, make_cam([1, 1], [5, 9])).workspace is None


@pytest.mark.parametrize("sms", [78, 132])
@pytest.mark.parametrize("preset,head_dim", [("tq4", 128), ("tq4", 256), ("tq3", 128), ("k5v4", 128)])
def test_split_choice_is_the_kernels_and_fixed_by_batch_shape(sms, preset, head_dim):
    p = get_preset(preset)
    layout = cache_layout(p, head_dim, 8, 16)
    launch = decode_launch(p, head_dim)
    for seqs in (2, 3, 8, 64, 256):
        assert decode_num_splits(seqs, layout, sms) == split_count(seqs, 8, sms, launch.programs_per_sm,
                                                                   launch.max_splits)
    # at most 16 splits of two or more sequences at head_dim 256 (tq4), 32 elsewhere
    assert launch.max_splits == (16 if (preset, head_dim) == ("tq4", 256) else 32)
    # one sequence: the per-warp decode kernel takes up to 64 splits, the general kernel (5-bit keys) 32
    one = decode_num_splits(1, layout, sms)
    assert one == split_count(1, 8, sms, launch.programs_per_sm, launch.max_splits_one_sequence)
    assert one == (64 if preset != "k5v4" else 32)
    assert decode_num_splits(0, layout, sms) == 1
