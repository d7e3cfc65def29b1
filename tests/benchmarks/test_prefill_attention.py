"""benchmarks/prefill_attention.py without a GPU: the FLOP count and the written table."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import prefill_attention as pa  # noqa: E402


def test_causal_flops_counts_the_keys_each_query_attends():
    per_key = 4 * pa.HEAD_DIM * pa.Q_HEADS
    assert pa.causal_flops(1, 1, 0) == per_key
    assert pa.causal_flops(1, 3, 0) == per_key * (1 + 2 + 3)
    assert pa.causal_flops(2, 2, 5) == 2 * per_key * (6 + 7)


def test_write_puts_every_row_in_json_and_markdown(tmp_path, monkeypatch):
    monkeypatch.setattr(pa.torch.cuda, "get_device_name", lambda: "test GPU")
    rows = [dict(kv="bf16", step="2x8192+0", time_ms=0.993, tflops=554.0, vs_bf16=1.0),
            dict(kv="tq4", step="2x8192+0", time_ms=1.082, tflops=508.0, vs_bf16=0.918),
            dict(kv="tq4 store", step="2x8192+0", time_ms=0.051, tflops=None, vs_bf16=None)]
    pa.write(rows, tmp_path)
    assert json.loads((tmp_path / "prefill_attention.json").read_text())["rows"] == rows
    md = (tmp_path / "prefill_attention.md").read_text()
    assert "| tq4 | 2x8192+0 | 1.082 | 508 | 0.92x |" in md and "test GPU" in md
    assert "| tq4 store | 2x8192+0 | 0.051 |  |  |" in md
    assert (tmp_path / "prefill_attention.png").stat().st_size > 0
