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
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="junk.safetensors is not a TurboQuant key calibration.*calibrate`"):
        load_calibration(junk)
    with pytest.raises(ValueError, match="finite and positive"):
        KeyCalibration(torch.zeros(1, 4), torch.tensor([[1.0, 0.0, 1.0, 1.0]]))
    with pytest.raises(ValueError, match="kv_heads, head_dim"):
        KeyCalibration(torch.zeros(4), torch.ones(4))
    with pytest.raises(ValueError, match="too few"):
        KeyStatistics(1, 4).fit()


def sink_case(seed: int, d: int = 128, n: int = 64):
    """Keys around a large mean (one KV head), token 0 an attention sink: a small key far from the mean."""
    gen = torch.Generator().manual_seed(seed)
    mean = torch.randn(1, d, generator=gen) * 3
    cal = KeyCalibration(mean, torch.exp(torch.empty(1, d).uniform_(-0.5, 0.5, generator=gen)))
    keys = mean + torch.randn(n, 1, d, generator=gen)
    keys[0] = 0.2 * keys[1:].norm(dim=-1).mean() * torch.nn.functional.normalize(torch.randn(1, d, generator=gen))
    return cal, keys, torch.randn(16, 1, d, generator=gen)


def test_sink_keys_are_stored_uncentered():
    """The shorter of (k - m) / s and k / s is stored: the sink uncentered with a negative norm, the rest centered;
    a zero key too, its norm still strictly negative."""
    cal, keys, _ = sink_case(4)
    keys[5] = 0.0
    x, centered = cal.choose_keys(keys)
    assert not centered[0] and not centered[5] and centered[1:5].all() and centered[6:].all()
    torch.testing.assert_close(x[0], keys[0] / cal.scale)
    torch.testing.assert_close(x[1], cal.keys(keys[1:2])[0])
    packed, norms = cal.quantize(Quantizer(4, 128), keys)
    assert (norms[0] < 0).all() and (norms[5] < 0).all() and (norms[[1, 2, 3, 4]] > 0).all() and (norms[6:] > 0).all()
    assert norms[5].item() == -(2.0**-100)
    torch.testing.assert_close(cal.dequantize(Quantizer(4, 128), packed[5:6], norms[5:6]), -cal.offset[None])


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_dequantized_keys_give_the_scores_up_to_one_shift_per_query(bits):
    """(q * s).x_hat of every stored key, centered or not, is q.k - q.m up to the quantization error; the sink's
    score error is a fraction of what storing it centered would give."""
    cal, keys, q = sink_case(5)
    quant = Quantizer(bits, 128)
    want = torch.einsum("qhd,khd->qk", q, keys) - cal.query_offsets(q)
    got = torch.einsum("qhd,khd->qk", cal.queries(q), cal.dequantize(quant, *cal.quantize(quant, keys)))
    centered = torch.einsum("qhd,khd->qk", cal.queries(q), quant.dequantize(*quant.quantize(cal.keys(keys))))
    err, err_centered = (got - want).abs(), (centered - want).abs()
    assert (err.pow(2).mean() / want.pow(2).mean()).sqrt() < {2: 0.5, 3: 0.3, 4: 0.15}[bits]  # ~ sqrt of the MSE
    assert err[:, 0].pow(2).mean() < 0.1 * err_centered[:, 0].pow(2).mean()
    torch.testing.assert_close(err[:, 1:], err_centered[:, 1:], rtol=0, atol=0)  # centered keys: as before
    # rotated: the same keys in the cache's basis
    rotated = cal.dequantize(quant, *cal.quantize(quant, keys), rotated=True)
    torch.testing.assert_close(rotated @ quant.rotation(), cal.dequantize(quant, *cal.quantize(quant, keys)),
                               rtol=1e-5, atol=1e-5)
