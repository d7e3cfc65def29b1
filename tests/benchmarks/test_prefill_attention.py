"""benchmarks.prefill_attention without a GPU: the FLOP count, the result path and the written table."""

import json

from benchmarks import common
from benchmarks import prefill_attention as pa


def test_causal_flops_counts_the_keys_each_query_attends():
    per_key = 4 * pa.HEAD_DIM * pa.Q_HEADS
    assert pa.causal_flops(1, 1, 0) == per_key
    assert pa.causal_flops(1, 3, 0) == per_key * (1 + 2 + 3)
    assert pa.causal_flops(2, 2, 5) == 2 * per_key * (6 + 7)


def test_default_path_names_the_gpu_and_the_steps():
    assert pa.default_stem(pa.STEPS, "h100") == common.RESULTS / "prefill_attention" / "h100-16q4kv"
    assert pa.default_stem("2x8192+0,1x1024+0", "h200").name == "h200-16q4kv-2x8192+0-1x1024+0"


def test_write_puts_every_row_in_json_and_markdown(tmp_path):
    meta = dict(common.provenance("python -m benchmarks prefill_attention"), gpu="test GPU")
    rows = [dict(kv="bf16", step="2x8192+0", time_ms=0.993, tflops=554.0, vs_bf16=1.0),
            dict(kv="tq4", step="2x8192+0", time_ms=1.082, tflops=508.0, vs_bf16=0.918),
            dict(kv="tq4 store", step="2x8192+0", time_ms=0.051, tflops=None, vs_bf16=None)]
    pa.write(rows, tmp_path / "h100-16q4kv", meta)
    doc = json.loads((tmp_path / "h100-16q4kv.json").read_text())
    assert doc["rows"] == rows and doc["meta"]["device"] == "test GPU" and doc["meta"]["q_heads"] == pa.Q_HEADS
    assert doc["meta"]["command"] == "python -m benchmarks prefill_attention"
    md = (tmp_path / "h100-16q4kv.md").read_text()
    assert "| tq4 | 2x8192+0 | 1.082 | 508 | 0.92x |" in md and "test GPU" in md
    assert "| tq4 store | 2x8192+0 | 0.051 |  |  |" in md
    assert (tmp_path / "h100-16q4kv.png").stat().st_size > 0
