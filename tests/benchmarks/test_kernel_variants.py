"""benchmarks.kernel_variants without a GPU: the variant specs and the table."""

from benchmarks import kernel_variants as kv


def test_variant_specs_default_stages_and_splits():
    got = kv.configs(["a=1,32,168", "b=1,64,0,5", "c=4,128,0,3,16", "d=1,32,168,5,32,32", "e=1,32,168,5,64,0,2",
                      "f=1,32,168,5,0,0,0,2"])
    assert got["policy"] == {}
    assert got["a"] == {"num_warps": 1, "block_n": 32, "max_registers": 168, "num_stages": 3}
    assert got["b"] == {"num_warps": 1, "block_n": 64, "max_registers": 0, "num_stages": 5}
    assert got["c"]["num_splits"] == 16 and "min_split_tokens" not in got["c"]
    assert got["d"] == {"num_warps": 1, "block_n": 32, "max_registers": 168, "num_stages": 5, "num_splits": 32,
                        "min_split_tokens": 32}
    assert got["e"] == {"num_warps": 1, "block_n": 32, "max_registers": 168, "num_stages": 5, "num_splits": 64,
                        "merge_rows": 2}
    assert got["f"] == {"num_warps": 1, "block_n": 32, "max_registers": 168, "num_stages": 5, "head_split": 2}
    assert kv.shapes_of(kv.SHAPES) == [(16, 4, 64, 8192), (16, 4, 32, 32768), (32, 8, 64, 8192)]


def test_markdown_rows_and_failures():
    base = dict(preset="tq4", head_dim=128, q_heads=16, kv_heads=4, batch=64, context=8192)
    rows = [dict(base, variant="policy", time_ms=0.1196, gbps=2384.2, rel_error=1.87e-3, nan=False),
            dict(base, variant="a", error="RuntimeError('out of resources')")]
    md = kv.markdown(rows, kv.configs(["a=1,32,168"]))
    assert "| tq4 d128 16/4 64x8192 | policy | 0.1196 | 2384 | 1.87e-03 |" in md
    assert "| tq4 d128 16/4 64x8192 | a | failed: RuntimeError('out of resources') | | |" in md
