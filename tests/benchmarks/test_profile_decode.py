"""benchmarks.profile_decode without a GPU: the child protocol, the result path and the written table."""

import sys

from benchmarks import common, e2e, profile_decode


def test_child_row_reads_the_last_tagged_line_and_keeps_the_log(tmp_path):
    script = "print('noise'); print('ROW {\"a\": 1}'); print('ROW {\"a\": 2}')"
    row = e2e.child_row([sys.executable, "-c", script], {}, tmp_path / "child.log", "ROW")
    assert row == {"a": 2} and "noise" in (tmp_path / "child.log").read_text()
    assert e2e.child_row([sys.executable, "-c", "raise SystemExit(3)"], {}, tmp_path / "bad.log", "ROW") is None


def test_markdown_lists_kernels_per_step_and_layer():
    rows = [dict(kv="tq4", batch=64, context=8192, us_per_step=4959.0, launches_per_step=234.0,
                 launches_per_layer=14.625, kernels=[dict(name="_attention_kernel", us_per_step=3773.6,
                                                          launches_per_step=16.0)])]
    md = profile_decode.markdown(rows, "python -m benchmarks profile_decode")
    assert "## tq4: 64 x 8192, GPU time 4,959 µs per decode step, 234 launches (14.6 per layer)" in md
    assert "| `_attention_kernel` | 3,773.6 | 16 |" in md


def test_default_path_names_the_gpu_and_the_shape():
    assert profile_decode.default_stem("16/4", 32, 32768, "h200") == common.RESULTS / "profile_decode" / "h200-32x32k"
    assert profile_decode.default_stem("32/8", 64, 8192, "h100").name == "h100-32q8kv-64x8k"
