"""Marlin's weight layout (quant.quartet2.kernels.marlin_layout) on the CPU, made by vLLM's own
prepare_fp4_layer_for_marlin with vLLM's plain-PyTorch gptq_marlin_repack (conftest.py): the probed tables are one
permutation of the tile, the layout the kernels are written for; another layout is refused with the way out."""

import pytest
import torch

from tests.conftest import DEVICE
from turboquant_vllm.quant.quartet2.kernels import marlin_layout


def test_the_probed_tables_are_one_permutation_of_the_tile(marlin_layout_on_cpu):
    t = marlin_layout.tables(torch.device(DEVICE), torch.bfloat16)
    assert t.word.shape == t.shift.shape == (16, 64) and t.scale_column.shape == (64,)
    place = (t.word * 8 + t.shift // 4).reshape(-1)
    assert torch.equal(place.sort().values.cpu(), torch.arange(1024))
    assert torch.equal(t.scale_column.sort().values.cpu(), torch.arange(64, dtype=torch.int32))
    assert not torch.equal(t.scale_column.cpu(), torch.arange(64, dtype=torch.int32))  # a permutation, not none


def test_the_decoder_is_written_for_the_layout_vllm_makes(marlin_layout_on_cpu):
    t = marlin_layout.tables(torch.device(DEVICE), torch.bfloat16)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(t, marlin_layout.tile_layout()))


def test_another_tiled_layout_is_refused_with_the_way_out(marlin_layout_on_cpu, monkeypatch):
    word, shift = marlin_layout.tile_layout()[:2]
    monkeypatch.setattr(marlin_layout, "weight_tables", lambda repack: (word.flip(1), shift))
    with pytest.raises(RuntimeError, match="TURBOQUANT_QUARTET2_DENSE_MIN_TOKENS=0"):
        marlin_layout.tables(torch.device(DEVICE), torch.bfloat16)


def test_a_layout_that_is_not_tiled_is_refused():
    with pytest.raises(RuntimeError, match="not one permutation per 16 x 64 tile"):
        marlin_layout.weight_tables(lambda q, k, n: torch.arange(k // 8 * n, dtype=torch.int32).reshape(-1, 2 * n))
