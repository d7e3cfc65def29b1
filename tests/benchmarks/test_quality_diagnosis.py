"""benchmarks.quality_diagnosis on the CPU with a tiny random Llama (no model files)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import quality_diagnosis as qd

HEAD_DIM = 32


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = qd.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=64)
    m = qd.Llama(cfg)
    m.init_weights(std=0.2)  # large enough that attention is not uniform
    return m.eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))


@torch.inference_mode()
def test_noop_hook_equals_plain_forward(model, ids):
    plain = model(ids)
    assert torch.equal(qd.forward(model, ids), plain)
    assert torch.equal(qd.forward(model, ids, lambda i, k, v: (k, v)), plain)
    assert torch.equal(qd.forward(model, ids, qd.kv_hook(qd.KVConfig("exact"))), plain)
    # restarting at layer 1 from the reference's own layer-1 input changes nothing either
    inputs = []
    qd.forward(model, ids, inputs=inputs)
    assert torch.equal(qd.forward(model, ids, start=1, h=inputs[1]), plain)


@torch.inference_mode()
def test_quantized_forward_differs(model, ids):
    ref = qd.next_token_logp(model(ids))
    q = qd.next_token_logp(qd.forward(model, ids, qd.kv_hook(qd.KVConfig("tq3", k=3, v=3))))
    assert qd.kl_per_position(ref, q).mean() > 0


def test_norm_correction_restores_the_norm():
    x = torch.randn(1024, HEAD_DIM, generator=torch.Generator().manual_seed(2)) * 3
    norms = torch.linalg.vector_norm(x, dim=-1)
    for bits in (2, 3, 4):
        plain = torch.linalg.vector_norm(qd.fake_quant(x, bits), dim=-1)
        # the plain reconstruction shrinks on average: E||x_hat||^2 = (1 - MSE) ||x||^2
        mse = qd.Quantizer(bits, HEAD_DIM).codebook.distortion
        assert (plain / norms).pow(2).mean().item() == pytest.approx(1 - mse, abs=0.2 * mse)
        corrected = qd.fake_quant(x, bits, norm_correct=True)
        torch.testing.assert_close(torch.linalg.vector_norm(corrected, dim=-1), norms, rtol=1e-5, atol=0)
        # same direction as the plain reconstruction: only the length changes
        cos = torch.nn.functional.cosine_similarity(corrected, qd.fake_quant(x, bits), dim=-1)
        torch.testing.assert_close(cos, torch.ones_like(cos))


def test_kl():
    logp = torch.randn(3, 5, 50).log_softmax(-1)
    assert torch.equal(qd.kl_per_position(logp, logp), torch.zeros(3, 5))
    other = (logp + 0.3 * torch.randn_like(logp)).log_softmax(-1)
    assert (qd.kl_per_position(logp, other) > 0).all()
    expected = torch.nn.functional.kl_div(other, logp, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(qd.kl_per_position(logp, other), expected)


@pytest.mark.parametrize("n", [1, 4])
def test_first_tokens_exact_are_bit_identical(n):
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 2, 10, HEAD_DIM, generator=gen), torch.randn(2, 2, 10, HEAD_DIM, generator=gen)
    kq, vq = qd.kv_hook(qd.KVConfig("t", k=4, v=3, exact_first=n, nc="kv"))(0, k, v)
    assert torch.equal(kq[..., :n, :], k[..., :n, :]) and torch.equal(vq[..., :n, :], v[..., :n, :])
    assert not torch.equal(kq[..., n:, :], k[..., n:, :]) and not torch.equal(vq[..., n:, :], v[..., n:, :])
    # the rest is quantized exactly as without the option
    kfull, _ = qd.kv_hook(qd.KVConfig("t", k=4, v=3, nc="kv"))(0, k, v)
    assert torch.equal(kq[..., n:, :], kfull[..., n:, :])


def test_layers_outside_the_config_stay_exact():
    k = v = torch.randn(1, 2, 6, HEAD_DIM)
    hook = qd.kv_hook(qd.KVConfig("t", k=4, v=4, layers=(1,)))
    assert all(torch.equal(a, b) for a, b in zip(hook(0, k, v), (k, v)))
    assert not torch.equal(hook(1, k, v)[0], k)


@torch.inference_mode()
def test_key_centering_is_exact(model, ids):
    """A fixed vector taken off every key only shifts each query's logits by a constant: softmax ignores it.
    Taking c_v off the values and adding it back after attention is exact too (weights sum to 1)."""
    gen = torch.Generator().manual_seed(5)
    shift = {i: (torch.randn(1, 2, 1, HEAD_DIM, generator=gen), torch.randn(1, 2, 1, HEAD_DIM, generator=gen))
             for i in range(2)}
    centered = qd.forward(model, ids, lambda i, k, v: (k - shift[i][0], v))
    torch.testing.assert_close(centered, model(ids), rtol=1e-4, atol=1e-4)
    # with an exact "quantizer" the centered hook gives back K and V (up to rounding of x - c + c)
    k, v = torch.randn(1, 2, 6, HEAD_DIM), torch.randn(1, 2, 6, HEAD_DIM)
    kc, vc = qd.kv_hook(qd.KVConfig("c", center="kv"), qd.Fitted(shift))(0, k, v)
    torch.testing.assert_close((kc, vc), (k, v))
    # and the centers are taken out before quantizing: the error shrinks with the quantized norm
    mean = {0: (k.mean(2, keepdim=True) + 5, v.mean(2, keepdim=True))}
    plain = qd.kv_hook(qd.KVConfig("p", k=3))(0, k + 5, v)[0]
    centered = qd.kv_hook(qd.KVConfig("c", k=3, center="k"), qd.Fitted(mean))(0, k + 5, v)[0]
    assert (centered - (k + 5)).norm() < 0.5 * (plain - (k + 5)).norm()
    with pytest.raises(ValueError):
        qd.kv_hook(qd.KVConfig("c", k=4, center="k"))


def test_fp8_is_a_plain_cast():
    x = torch.tensor([[0.1, 1.0, 3.3, -17.2]])
    assert torch.equal(qd.fake_quant(x, "fp8"), x.to(torch.float8_e4m3fn).float())


def test_bytes_per_token():
    kw = dict(num_layers=6, head_dim=128, seq_len=2048)
    assert qd.KVConfig("tq4", k=4, v=4).bytes_per_token(**kw) == 136
    assert qd.KVConfig("nc", k=4, v=4, nc="kv").bytes_per_token(**kw) == 136  # norm correction is free
    assert qd.KVConfig("fp8", k="fp8", v="fp8").bytes_per_token(**kw) == 256
    assert qd.KVConfig("k only", k=4).bytes_per_token(**kw) == 68 + 256
    boundary = qd.KVConfig("b", k=4, v=4, layers=(1, 2, 3, 4, 5))
    assert boundary.bytes_per_token(**kw) == pytest.approx((512 + 5 * 136) / 6)  # an exact layer: 512 B
    assert qd.KVConfig("f", k=4, v=4, exact_first=16).bytes_per_token(**kw) == pytest.approx(136 + 16 * 376 / 2048)


@torch.inference_mode()
def test_evaluate_end_to_end(model):
    windows = torch.randint(1, 64, (3, 16), generator=torch.Generator().manual_seed(4))
    windows[:, 0] = qd.BOS
    configs = [qd.KVConfig("exact layer", k=4, v=4, layers=()), qd.KVConfig("tq2", k=2, v=2),
               qd.KVConfig("tq2 layer 1", k=2, v=2, layers=(1,))]
    out = qd.evaluate(model, windows, configs, batch=2, log=lambda *_: None)
    assert out["reference"]["tokens"] == 3 * 15
    assert out["tq2"]["kl"] > out["tq2 layer 1"]["kl"] > 0
    assert out["tq2"]["ppl_delta_pct"] != 0


def test_key_calibration_scores_equal_the_products():
    """Undoing the transform after dequantizing (k_hat = s * x_hat + m) gives the scores of the product's
    (q * s).x_hat up to q.m per query, so the softmax is the same."""
    from turboquant_vllm.core.calibration import KeyCalibration

    gen = torch.Generator().manual_seed(7)
    mean, scale = torch.randn(2, HEAD_DIM, generator=gen) * 3, torch.rand(2, HEAD_DIM, generator=gen) + 0.5
    fitted = qd.Fitted({}, {0: (mean[None, :, None], scale[None, :, None])})
    k, v = torch.randn(1, 2, 9, HEAD_DIM, generator=gen), torch.randn(1, 2, 9, HEAD_DIM, generator=gen)
    q = torch.randn(1, 4, 9, HEAD_DIM, generator=gen)  # 2 query heads per KV head
    k_hat = qd.kv_hook(qd.KVConfig("c", k=4, nc="k", key_cal="mean+scale"), fitted)(0, k, v)[0]
    cal = KeyCalibration(mean, scale)  # the product: cache (k - m) / s, attend with q * s
    x_hat = qd.fake_quant(cal.keys(k[0].transpose(0, 1)), 4, True)  # (tokens, kv_heads, d)
    q_s = cal.queries(q[0].transpose(0, 1))  # (tokens, q_heads, d)
    product = torch.einsum("thd,shd->hts", q_s, x_hat.repeat_interleave(2, 1))
    ours = torch.einsum("htd,hsd->hts", q[0], k_hat[0].repeat_interleave(2, 0))
    torch.testing.assert_close(product.softmax(-1), ours.softmax(-1), rtol=1e-4, atol=1e-5)
    # with an exact "quantizer" every variant gives K back
    for kc in ("mean", "scale", "mean+scale"):
        torch.testing.assert_close(qd.kv_hook(qd.KVConfig("c", key_cal=kc), fitted)(0, k, v)[0], k)
    with pytest.raises(ValueError, match="two key means"):
        qd.kv_hook(qd.KVConfig("c", k=4, center="k", key_cal="mean"), qd.Fitted({0: (mean, mean)}, fitted.key_cal))(
            0, k, v)


def test_load_key_calibration_maps_vllm_layer_names(tmp_path):
    from turboquant_vllm.core.calibration import KeyCalibration, save_calibration

    cal = {f"model.layers.{i}.self_attn.attn": KeyCalibration(torch.full((2, 8), float(i)), torch.ones(2, 8))
           for i in (1, 0)}
    save_calibration(tmp_path / "c.safetensors", cal)
    out = qd.load_key_calibration(tmp_path / "c.safetensors", 2)
    assert sorted(out) == [0, 1] and out[1][0].shape == (1, 2, 1, 8) and out[1][0].unique().item() == 1
    with pytest.raises(ValueError, match="the model has 3"):
        qd.load_key_calibration(tmp_path / "c.safetensors", 3)


def test_codebook_helpers_agree_with_core():
    checks = qd.self_check(HEAD_DIM)
    assert checks["helper_vs_core_max_abs"] < 1e-5 and checks["histogram_vs_core_4bit_max_rel"] < 1e-5
    kw = dict(num_layers=6, head_dim=128, seq_len=2048)
    assert qd.KVConfig("k5v3", k=5, v=3).bytes_per_token(**kw) == 136
    assert qd.KVConfig("k5v4", k=5, v=4).bytes_per_token(**kw) == 152


def test_fitted_codebook():
    """On keys that are sphere-like after the rotation, the fitted magnitudes are the sphere's; on keys
    that are not (a few large channels survive a rotation that is not random for them), they differ and
    quantize those keys better."""
    gen = torch.Generator().manual_seed(9)
    sphere = torch.randn(1, 2, 4096, HEAD_DIM, generator=gen)
    rot = qd.rotation_matrix(HEAD_DIM, 0)
    spiky = torch.zeros(1, 2, 4096, HEAD_DIM)
    spiky[..., :4] = torch.randn(1, 2, 4096, 4, generator=gen)
    spiky = (spiky + 0.05 * torch.randn(spiky.shape, generator=gen)) @ rot  # spiky in the rotated basis
    cfg = qd.KVConfig("f", k=4, v=4, k_codebook="fitted")
    for keys, close in ((sphere, True), (spiky, False)):
        fitted = qd.Fitted({}, calib_keys={0: keys})
        mags = fitted.key_magnitudes(cfg, 0)
        assert mags.shape == (8,) and bool((mags.diff() > 0).all())
        assert torch.allclose(mags, qd.sphere_magnitudes(4, HEAD_DIM), rtol=0.03) == close
        (row,) = next(iter(fitted.fits.values()))
        assert row["fitted_unit_mse"] <= row["sphere_unit_mse"] * (1 + 1e-9)
        if not close:
            assert row["fitted_unit_mse"] < 0.8 * row["sphere_unit_mse"]
            k_hat = qd.kv_hook(cfg, fitted)(0, keys, keys)[0]
            plain = qd.fake_quant(keys, 4)
            assert (k_hat - keys).pow(2).sum() < (plain - keys).pow(2).sum()


def test_paired_differences():
    results = {"a": {"kl_per_window": [1.0, 2.0, 3.0], "nll_delta_per_window": [0.0, 0.0, 0.0]},
               "b": {"kl_per_window": [1.5, 2.5, 3.5], "nll_delta_per_window": [0.1, 0.1, 0.1]}}
    p = qd.paired(results, "b", "a")
    assert p["kl"] == pytest.approx((0.5, 0.0)) and p["nll_delta"] == pytest.approx((0.1, 0.0))
