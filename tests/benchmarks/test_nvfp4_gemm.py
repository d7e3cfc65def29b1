"""benchmarks.nvfp4_gemm without a GPU: its tables from rows."""

from benchmarks import nvfp4_gemm


def rows():
    out = [dict(K=64, N=128, tokens=0, path="decode", time_ms=0.01, weight_gbps=2000.0)]
    for path, ms in zip([p for p in nvfp4_gemm.PATHS if p != "mma"], (0.02, 0.04, 0.025, 0.025)):  # 1,024: no mma
        out.append(dict(K=64, N=128, tokens=1024, path=path, time_ms=ms, weight_gbps=1.0, tflops=1.0, nan=False,
                        rel_error=1e-3))
    return out


def blocks():
    return [dict(block="cloverlm-4b", tokens=1, path=path, time_ms=ms, weight_gbps=gbps)
            for path, ms, gbps in zip(nvfp4_gemm.PATHS, (0.0792, 0.0589, 0.0331, 0.2499, 0.0331),
                                      (3407, 1288, 2292, 304, 2292))]


def test_markdown_has_every_row_and_the_speed_against_dense():
    md = nvfp4_gemm.markdown(rows(), blocks(), "cloverlm-4b", 512, 8)
    assert "| 64x128 | - | decode | 0.0100 | 2000 | - | - |" in md
    assert "| 64x128 | 1024 | marlin | 0.0400 |" in md
    assert "| 64x128 | 1024 | 0.50x | - | 0.80x | 0.80x |" in md
    assert "Marlin below 512 tokens" in md
    assert "| 1 | marlin | 58.9 | 1288 |" in md and "| 1 | mma | 33.1 | 2292 |" in md
    assert "read from HBM (4 copies" in md


def test_markdown_without_block_rows_has_no_block_table():
    md = nvfp4_gemm.markdown(rows(), [], "cloverlm-4b", 512, 8)
    assert "µs / block" not in md and "| 64x128 | 1024 | marlin | 0.0400 |" in md


def test_every_model_has_four_layers():
    assert all(len(shapes) == 4 for shapes in nvfp4_gemm.MODELS.values())
    assert nvfp4_gemm.MODELS["cloverlm-4b"][2] == (3584, 14336)
