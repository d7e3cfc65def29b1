"""benchmarks.layer_step without a GPU: the written table."""

from benchmarks import layer_step


def test_markdown_puts_host_and_gpu_time_side_by_side():
    rows = [dict(step="tq4", batch=64, context=512, host_us=61.25, gpu_us=12.5),
            dict(step="flash_attn_bf16", batch=64, context=512, host_us=20.0, gpu_us=8.0)]
    md = layer_step.markdown(rows, "9 q / 3 KV heads, d 64")
    assert "(9 q / 3 KV heads, d 64)" in md
    assert "| tq4 | 64 x 512 | 61.2 | 12.5 | 4.9 |" in md and "| flash_attn_bf16 | 64 x 512 | 20.0 | 8.0 | 2.5 |" in md
