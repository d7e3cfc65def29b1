"""benchmarks.decode_sweep without a GPU: the launch policy over every point of the sweep, merging, the report."""

import json

import pytest

from benchmarks import decode_sweep as sweep
from turboquant_vllm.core.layout import CacheLayout
from turboquant_vllm.core.presets import get_preset
from turboquant_vllm.ops.attention import attention_workspace_shape, decode_launch, decode_num_splits
from turboquant_vllm.ops.attention.launch import per_warp_decode


@pytest.mark.parametrize("sms", [132, 78, 16])
def test_launch_policy_covers_every_point(sms):
    """Every (group, head_dim, batch, context) of the sweep gets the per-warp decode kernel, a split count the merge
    takes, and a workspace that stays small; the uncapped candidates only ever add splits."""
    for group, head_dim, batch, context in sweep.configs(sweep.GROUPS, sweep.HEAD_DIMS, sweep.POINTS):
        layout = CacheLayout(get_preset(sweep.PRESET), head_dim, sweep.KV_HEADS, 16)
        assert per_warp_decode(layout.preset)
        launch = decode_launch(layout.preset, head_dim)
        assert launch.num_warps == 1 and launch.programs_per_sm > 0
        splits = decode_num_splits(batch, layout, sms)
        assert 1 <= splits and splits & (splits - 1) == 0, (group, head_dim, batch, splits)
        ws = attention_workspace_shape(batch, group * sweep.KV_HEADS, head_dim, splits)[0] * 4
        assert ws < 256 * 1024**2, (group, head_dim, batch, ws)
        extra = sweep.split_candidates(batch, sweep.KV_HEADS, sms, launch.programs_per_sm, splits)
        assert all(s > splits for s in extra) and extra == sorted(extra)


def test_points_span_the_issue_axes():
    assert set(sweep.GROUPS) == {1, 2, 3, 4, 5, 6, 7, 8, 16}
    assert set(sweep.HEAD_DIMS) == {64, 96, 128, 256}
    batches = {b for b, _ in sweep.POINTS}
    contexts = {c for _, c in sweep.POINTS}
    assert min(batches) == 1 and max(batches) == 256 and min(contexts) <= 1024 and max(contexts) >= 128 * 1024


def test_split_candidates_only_where_capped():
    assert sweep.split_candidates(64, 8, 132, 6, 2) == []
    assert sweep.split_candidates(1, 8, 132, 6, 32) == [64, 128]
    assert sweep.parse_points("1x8192,256x1024") == [(1, 8192), (256, 1024)]


def point(group, head_dim, batch, context, bf16, ours, **kw):
    return dict(group=group, head_dim=head_dim, batch=batch, context=context, q_heads=8 * group, kv_heads=8,
                bf16_kv_bytes=sweep.bf16_kv_bytes(batch, context, 8, head_dim), ours_kv_bytes=1, bf16_ms=bf16,
                fp8_ms=bf16 * 0.8, ours_ms=ours, splits=32, **kw)


def test_merge_replaces_same_points_and_keeps_the_rest():
    meta = dict(kv_heads=8)
    old = dict(meta=meta, points=[point(1, 64, 1, 8192, 1.0, 2.0), point(2, 64, 1, 8192, 1.0, 0.5)],
               e2e=[dict(shape="x", ours_tok_s=2, bf16_tok_s=1)])
    new = dict(meta=meta, points=[point(1, 64, 1, 8192, 1.0, 0.4)], e2e=[])
    got = sweep.merge(old, new)
    assert [(p["group"], p["ours_ms"]) for p in got["points"]] == [(1, 0.4), (2, 0.5)]
    assert got["e2e"] == old["e2e"]


def test_report_targets_and_heatmap(tmp_path):
    big = (1, 131072)  # 1 x 128k x 8 KV heads x d 128: 4.3 GB of bf16
    doc = dict(meta=dict(gpu="GPU", kv_heads=8, block_size=16, timing="t", preset="tq4"),
               points=[point(3, 128, *big, 1.0, 0.5, ours_ms_by_splits={"64": 0.4, "128": 0.45}),
                       point(5, 128, 16, 2048, 1.0, 1.25), point(7, 64, 256, 1024, 1.0, 0.8)], e2e=[])
    md = sweep.markdown(doc)
    assert "| >= 1.0x FA3 bf16 at every point | FAIL | 2 of 3 points; lowest 0.80x (g5 d128 16x2k)" in md
    assert "| >= 1.5x where bf16 reads > 256 MB a layer | FAIL | 1 of 2 points; below: g7 d64 256x1k 1.25x |" in md
    assert "2.00x (2.50x at 64 splits)" in md and "As served" not in md
    doc["points"][1]["ours_served_ms"] = 0.9  # decode + merge alone: 1.11x where rotation + decode + merge is 0.80x
    doc["points"][2]["ours_served_ms"] = 1.1
    assert ("As served (decode + merge; vLLM's store launch rotates the queries): 1 of 2 points measured so >= 1.0x "
            "FA3 bf16; below: g7 d64 256x1k 0.91x.") in sweep.markdown(doc)
    path = tmp_path / "decode_sweep.json"
    path.write_text(json.dumps(doc))
    sweep.main(["--report", str(path), "--out", str(tmp_path / "out" / "sweep")])
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 10_000
    assert "head_dim 64" in (tmp_path / "out" / "sweep.md").read_text()
    assert json.loads((tmp_path / "out" / "sweep.json").read_text())["points"] == doc["points"]


def test_report_of_the_committed_result_prints_it_and_writes_nothing(tmp_path, capsys):
    """--report only reads: the table goes to stdout, the result file and its folder stay byte for byte."""
    committed = sweep.common.RESULTS / "decode_sweep.json"
    copy = tmp_path / "decode_sweep.json"
    copy.write_bytes(committed.read_bytes())
    sweep.main(["--report", str(copy)])
    out = capsys.readouterr().out
    assert out.endswith(sweep.markdown(json.loads(committed.read_text()))) and "head_dim" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode_sweep.json"]
    assert copy.read_bytes() == committed.read_bytes()


def test_e2e_rows_from_shape_results(tmp_path):
    e2e_doc = {"meta": {"shape": "qwen2.5-7b"},
               "rows": [{"kv": "bf16", "decode_tok_s_64x8k": 100.0, "decode_tok_s_32x32k": 50.0},
                        {"kv": "tq4", "decode_tok_s_64x8k": 90.0, "decode_tok_s_32x32k": 80.0},
                        {"kv": "fp8", "decode_tok_s_64x8k": 120.0}]}
    path = tmp_path / "h100-qwen2.5-7b.json"
    path.write_text(json.dumps(e2e_doc))
    rows = sweep.e2e_rows(path)
    assert [(r["shape"], r["ours_tok_s"], r["bf16_tok_s"]) for r in rows] == [
        ("qwen2.5-7b 64x8k", 90.0, 100.0), ("qwen2.5-7b 32x32k", 80.0, 50.0)]
    doc = {"meta": {"gpu": "GPU", "kv_heads": 8, "block_size": 16, "timing": "t"},
           "points": [point(1, 128, 64, 8192, 1.0, 0.5)], "e2e": [{"shape": "qwen2.5-7b 64x8k", "ours_tok_s": 1.0,
                                                                 "bf16_tok_s": 1.0}]}
    md = sweep.markdown(sweep.with_e2e(doc, [path]))
    assert "| end to end >= 1.0x bf16 for every model shape | FAIL | 1 of 2 runs; qwen2.5-7b 64x8k 0.90x |" in md
    assert "| qwen2.5-7b 32x32k | 80.0 | 50.0 | 1.60x |" in md
