"""turboquant_vllm.bench without a GPU: the batch it builds, the bytes it counts, the rows and table it makes."""

import pytest
import torch

from turboquant_vllm import bench


def test_batch_pages_are_a_shuffled_partition_and_slots_cover_them():
    shape = bench.Shape(3, 40, q_heads=4, kv_heads=2, head_dim=64)
    b = bench.Batch(shape, torch.Generator().manual_seed(0), device="cpu")
    assert b.num_blocks == 3 * 3  # 40 tokens in blocks of 16
    assert sorted(b.block_table.flatten().tolist()) == list(range(b.num_blocks))
    assert b.query.shape == (3, 4, 64) and b.k_cache.shape == (9, bench.BLOCK, 2, 64)
    ids = torch.cat([i for i, _, _ in b.slot_chunks(chunk_blocks=4)])
    assert ids.tolist() == list(range(b.num_blocks))
    # KV bytes of every token and head, plus the block table (int32) and query + output (bf16)
    assert b.bytes_moved(136) == 3 * 40 * 2 * 136 + 9 * 4 + 2 * 3 * 4 * 64 * 2


def test_measure_times_each_kernel_against_bf16_and_reports_failures(monkeypatch):
    b = bench.Batch(bench.Shape(2, 32, 4, 2, 64), torch.Generator().manual_seed(0), device="cpu")
    times = {"fa3_bf16": 2.0, "tq4": 1.0}
    monkeypatch.setattr(bench, "time_graph", lambda fn: times[fn()])

    def broken():
        raise RuntimeError("no kernel for this shape")
    logged = []
    rows = bench.measure(b, {"fa3_bf16": lambda: (lambda: "fa3_bf16", 512), "k5v4": broken,
                             "tq4": lambda: (lambda: "tq4", 136)}, peak=1e12, log=logged.append)
    assert [r["kernel"] for r in rows] == ["fa3_bf16", "tq4"]
    assert rows[1]["speedup_vs_bf16"] == pytest.approx(2.0)
    assert rows[1]["gbps"] == pytest.approx(b.bytes_moved(136) / 1.0 / 1e6)
    assert logged and "k5v4" in logged[0] and "no kernel for this shape" in logged[0]
    lines = bench.table(rows)
    assert lines[0].startswith("| kernel |") and "| tq4 | 2 x 32 | 1.0000 |" in lines[-1] and "2.00x" in lines[-1]
