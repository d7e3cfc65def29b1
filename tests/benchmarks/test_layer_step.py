"""benchmarks.layer_step without a GPU: the written table, and the mixed step's launches (interpreted)."""

import pytest
import torch

from benchmarks import layer_step
from tests.conftest import DEVICE
from turboquant_vllm.bench import Batch, Shape
from turboquant_vllm.ops.attention.naive import paged_attention_reference


def test_markdown_puts_host_and_gpu_time_side_by_side():
    rows = [dict(step="tq4", batch=64, context=512, host_us=61.25, gpu_us=12.5),
            dict(step="flash_attn_bf16", batch=64, context=512, host_us=20.0, gpu_us=8.0)]
    md = layer_step.markdown(rows, "9 q / 3 KV heads, d 64")
    assert "(9 q / 3 KV heads, d 64)" in md
    assert "| tq4 | 64 x 512 |  | 61.2 | 12.5 | 4.9 |" in md
    assert "| flash_attn_bf16 | 64 x 512 |  | 20.0 | 8.0 | 2.5 |" in md
    md = layer_step.markdown([dict(rows[0], prefill=128)], "9 q / 3 KV heads, d 64")
    assert "| tq4 | 64 x 512 | 128 | 61.2 | 12.5 | 4.9 |" in md


@pytest.mark.slow  # interpreted kernels of a mixed step: ~12 s (CI's slow tier)
def test_mixed_step_attends_as_the_reference():
    """The benchmarked mixed step (decodes + a prefill through the general kernel), with the store's query rotation
    and with rotations of their own: the reference's attention over the pages the step leaves."""
    b = Batch(Shape(3, 40, 6, 2, 64), torch.Generator().manual_seed(0), device=DEVICE)
    m = layer_step.Mixed(b, 24)
    for separate in (False, True):
        run = layer_step.ours_mixed_step(m, "tq4", separate)
        out = run().float()
        ref = paged_attention_reference(m.query, run.cache, run.layout, m.block_table, m.qsl, m.seq_lens, 64**-0.5)
        assert not out.isnan().any()
        assert (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)).item() < 1e-2
