import pytest
import torch

from turboquant_vllm.core.calibration import KeyCalibration, KeyStatistics, load_calibration, save_calibration
from turboquant_vllm.core.quantizer import Quantizer


def test_softmax_ignores_the_transform():
    """(q * s).((k - m) / s) = q.k - q.m: one shift per query, so the attention weights are exact."""
    gen = torch.Generator().manual_seed(0)
    kv_heads, group, d = 3, 4, 32
    cal = KeyCalibration(torch.randn(kv_heads, d, generator=gen), torch.rand(kv_heads, d, generator=gen) + 0.2)
    q = torch.randn(5, kv_heads * group, d, generator=gen)
    k = torch.randn(7, kv_heads, d, generator=gen)
    kk = k.repeat_interleave(group, dim=1)  # query head j reads KV head j // group, as vLLM's GQA
    plain = torch.einsum("qhd,khd->hqk", q, kk).softmax(-1)
    moved = torch.einsum("qhd,khd->hqk", cal.queries(q), cal.keys(k).repeat_interleave(group, dim=1)).softmax(-1)
    torch.testing.assert_close(moved, plain, rtol=1e-5, atol=1e-6)


def test_fit_recovers_mean_and_balanced_scale():
    gen = torch.Generator().manual_seed(1)
    kv_heads, group, d, n = 2, 2, 16, 200_000
    mean = torch.randn(kv_heads, d, generator=gen) * 3
    k_std = torch.rand(kv_heads, d, generator=gen) * 4 + 0.5
    q_std = torch.rand(kv_heads, d, generator=gen) * 2 + 0.5
    stats = KeyStatistics(kv_heads, d)
    for _ in range(4):  # in pieces, as steps arrive
        stats.add_keys(mean + k_std * torch.randn(n // 4, kv_heads, d, generator=gen))
        stats.add_queries((q_std.repeat_interleave(group, 0) * torch.randn(n // 4, kv_heads * group, d, generator=gen)))
    cal = stats.fit()
    torch.testing.assert_close(cal.mean, mean, atol=0.05, rtol=0)
    want = (k_std / q_std).sqrt()
    want = want / want.log().mean(-1, keepdim=True).exp()  # geometric mean 1
    torch.testing.assert_close(cal.scale, want, rtol=0.02, atol=0)


def test_fit_survives_dead_channels():
    stats = KeyStatistics(1, 8)
    k = torch.randn(100, 1, 8)
    k[..., 3] = 2.0  # a constant key channel: zero variance
    q = torch.randn(100, 2, 8)
    q[..., 5] = 0.0  # a channel no query reads
    stats.add_keys(k)
    stats.add_queries(q)
    cal = stats.fit()
    assert torch.isfinite(cal.scale).all() and (cal.scale > 0).all()


def test_calibration_cuts_the_score_error_of_structured_keys():
    """Keys sharing a large mean and keeping their energy where queries do not look: the calibrated
    cache gives q.k (up to the per-query shift) with clearly less error than the plain one."""
    gen = torch.Generator().manual_seed(2)
    d, n = 128, 4000
    k_std = torch.ones(d)
    k_std[:16] = 6.0  # energetic key channels ...
    q_std = torch.ones(d)
    q_std[:16] = 0.1  # ... that queries barely read
    mean = torch.randn(d, generator=gen) * 4
    keys = (mean + k_std * torch.randn(n, d, generator=gen)).unsqueeze(1)
    queries = (q_std * torch.randn(n, d, generator=gen)).unsqueeze(1)
    stats = KeyStatistics(1, d)
    stats.add_keys(keys)
    stats.add_queries(queries)
    cal = stats.fit()
    quant = Quantizer(4, d)

    def score_error(k, q):  # the cache holds k; per query, minus its mean over keys: what softmax sees
        q = q[:256, 0]
        e = q @ quant.dequantize(*quant.quantize(k[:, 0])).T - q @ k[:, 0].T
        return (e - e.mean(1, keepdim=True)).pow(2).mean().item()

    plain = score_error(keys, queries)
    calibrated = score_error(cal.keys(keys), cal.queries(queries))
    assert calibrated < 0.5 * plain, (calibrated, plain)


def test_file_round_trip(tmp_path):
    gen = torch.Generator().manual_seed(3)
    layers = {f"model.layers.{i}.self_attn.attn": KeyCalibration(torch.randn(2, 64, generator=gen),
                                                                torch.rand(2, 64, generator=gen) + 0.5)
              for i in range(3)}
    path = tmp_path / "cal.safetensors"
    save_calibration(path, layers, {"tokens": 123})
    back = load_calibration(path)
    assert back.keys() == layers.keys()
    for name, cal in layers.items():
        assert torch.equal(back[name].mean, cal.mean) and torch.equal(back[name].scale, cal.scale)
    half = back["model.layers.0.self_attn.attn"].heads(1, 1)
    assert torch.equal(half.mean, layers["model.layers.0.self_attn.attn"].mean[1:2])


def test_bad_files_and_values_are_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist.*turboquant-vllm calibrate"):
        load_calibration(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file

    other = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, str(other))
    with pytest.raises(ValueError, match="not a TurboQuant key calibration"):
        load_calibration(other)
    with pytest.raises(ValueError, match="finite and positive"):
        KeyCalibration(torch.zeros(1, 4), torch.tensor([[1.0, 0.0, 1.0, 1.0]]))
    with pytest.raises(ValueError, match="kv_heads, head_dim"):
        KeyCalibration(torch.zeros(4), torch.ones(4))
    with pytest.raises(ValueError, match="too few"):
        KeyStatistics(1, 4).fit()
