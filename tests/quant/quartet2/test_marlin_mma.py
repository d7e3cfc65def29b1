"""The marlin path's few-token GEMM (quant.quartet2.marlin_mma) on the CPU, Triton's interpreter (its table decode in
place of the byte-permute PTX): Marlin's layout made by vLLM's own prepare_fp4_layer_for_marlin over vLLM's PyTorch
reference of the repack (test_marlin_dequant.py). Its output is the W4A16 product (the exact NVFP4 weight, fp32 sums)
rounded once; on the GPU, with the real repack and the PTX decode: test_gpu_marlin.py."""

import pytest
import torch

from tests.conftest import DEVICE
from tests.quant.quartet2.test_marlin import w4a16
from tests.quant.quartet2.test_marlin_dequant import marlin_layout_on_cpu, weight  # noqa: F401 (a fixture)
from turboquant_vllm.quant.quartet2 import linear, marlin, marlin_dequant, marlin_mma

CONFIGS = [marlin_mma.CONFIG, marlin_mma.Config(k_tiles=4, n_tiles=2, warps=1, programs_per_sm=1),
           marlin_mma.Config(k_tiles=8, n_tiles=1, warps=4, programs_per_sm=8, partial_budget=4.0)]


def assert_rounded_once(y, x, w):
    """y is the float64 W4A16 product rounded to y's dtype, up to the fp32 sums' error (far below an ulp)."""
    ref = w4a16(x, w)
    magnitude = x.double().abs() @ linear.unscaled_values(w.packed, w.scales).double().abs().t() * w.tensor_scale
    u = torch.finfo(y.dtype).eps / 2
    assert y.shape == ref.shape and y.dtype == x.dtype and not y.isnan().any()
    assert ((y.double() - ref).abs() <= u * ref.abs() + 2**-20 * magnitude.double()).all()
    assert (y.double() == ref.to(y.dtype).double()).float().mean() > 0.99  # nearly all exactly the rounded product


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_kernels_layout_is_the_probed_one(marlin_layout_on_cpu, dtype):  # noqa: F811
    assert marlin_mma.layout_matches(marlin_dequant.tables(torch.device(DEVICE), dtype))


def test_another_layout_is_told_apart():
    word, shift, column = marlin_mma.expected_tables()
    assert not marlin_mma.layout_matches(marlin_dequant.MarlinTables(word, shift, column.flip(0)))
    assert not marlin_mma.layout_matches(marlin_dequant.MarlinTables(word.flip(1), shift, column))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["quantized", "small scales"])
@pytest.mark.parametrize("shape", [(192, 256), (100, 208)], ids=["192x256", "100x208-padded"])
def test_the_gemm_is_the_w4a16_product_rounded_once(marlin_layout_on_cpu, shape, case, dtype, config):  # noqa: F811
    n, k = shape
    w = weight(n, k, 3 * n + k, case)
    m = marlin.prepare(w, dtype)
    gen = torch.Generator().manual_seed(n + k)
    part, tickets = marlin_mma.reserve_scratch(m.weight_scale.shape[1], k, m.weight.device, config)
    part.fill_(float("nan"))  # partials are read only where written
    for tokens in (1, 2, 7, 16, 17, 40, marlin_mma.MAX_TOKENS):
        x = torch.randn(tokens, k, generator=gen).to(dtype).to(DEVICE)
        y = marlin_mma.mma_linear(x, m.weight, m.weight_scale, n, k, m.dense_alpha, config)
        assert_rounded_once(y, x, w)
        assert (tickets == 0).all()  # reset for the next launch
    assert torch.equal(marlin_mma.mma_linear(x, m.weight, m.weight_scale, n, k, m.dense_alpha, config), y)


def test_groups_marlin_flushes_are_zeros(marlin_layout_on_cpu):  # noqa: F811
    w = weight(128, 160, 5, "tiny groups")
    m = marlin.prepare(w, torch.bfloat16)
    flushed = marlin.marlin_flushed_groups(w.scales, torch.bfloat16)
    assert flushed.any()
    kept = w._replace(scales=torch.where(flushed, 0, w.scales.float()).to(w.scales.dtype))
    x = torch.randn(2, 160, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(DEVICE)
    assert_rounded_once(marlin_mma.mma_linear(x, m.weight, m.weight_scale, 128, 160, m.dense_alpha), x, kept)


def test_splits_cover_k_fill_the_gpu_and_keep_the_partials_small():
    for padded_n, k in [(128, 16), (5376, 3584), (3584, 14336), (14336, 3584), (896, 208)]:
        for config in CONFIGS:
            for tokens in (1, 16, 64):
                g = marlin_mma.launch(padded_n, k, tokens, torch.device("cpu"), config)
                k_tiles = k // 16
                assert g.tiles_per_split % config.k_tiles == 0 and g.splits * g.tiles_per_split >= k_tiles
                assert (g.splits - 1) * g.tiles_per_split < k_tiles  # no empty split
                assert g.n_programs * config.n_tiles * 64 >= padded_n
                partials, weight_bytes = 8 * tokens * padded_n * g.splits, 0.5625 * padded_n * k
                assert g.splits == 1 or partials <= config.partial_budget * weight_bytes
    few, many = (marlin_mma.launch(5376, 3584, t, torch.device("cpu")) for t in (1, 64))
    assert few.splits > many.splits == 1


def test_the_marlin_path_takes_it_up_to_its_threshold(marlin_layout_on_cpu, monkeypatch):  # noqa: F811
    monkeypatch.delenv(marlin.MMA_ENV, raising=False)
    w = weight(192, 160, 7)
    m = marlin.prepare(w, torch.bfloat16)
    assert m.mma_max_tokens == marlin_mma.MAX_TOKENS
    x = torch.randn(2, 2, 160, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16).to(DEVICE)
    y = marlin.marlin_linear(x, m)
    assert y.shape == (2, 2, 192)
    assert torch.equal(y.reshape(4, 192), marlin_mma.mma_linear(x.reshape(4, 160), m.weight, m.weight_scale, 192, 160,
                                                                m.dense_alpha))


def test_the_threshold_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(marlin.MMA_ENV, raising=False)
    assert marlin.mma_threshold() == marlin_mma.MAX_TOKENS
    monkeypatch.setenv(marlin.MMA_ENV, "0")
    assert marlin.mma_threshold() == 0
    for bad in ("lots", str(marlin_mma.MAX_TOKENS + 1)):
        monkeypatch.setenv(marlin.MMA_ENV, bad)
        with pytest.raises(ValueError, match="token count"):
            marlin.mma_threshold()


def test_it_refuses_what_it_cannot_take(marlin_layout_on_cpu):  # noqa: F811
    m = marlin.prepare(weight(128, 160, 9), torch.bfloat16)
    for x in (torch.zeros(marlin_mma.MAX_TOKENS + 1, 160), torch.zeros(0, 160), torch.zeros(160, 2).t()):
        with pytest.raises(ValueError, match="tokens"):
            marlin_mma.mma_linear(x.to(torch.bfloat16).to(DEVICE), m.weight, m.weight_scale, 128, 160, 1.0)
