"""benchmarks/quality_diagnosis.py on the CPU with a tiny random Llama (no model files)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# loaded by path: some wheels install a top-level `benchmarks` package into site-packages
_spec = importlib.util.spec_from_file_location("quality_diagnosis", ROOT / "benchmarks" / "quality_diagnosis.py")
qd = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = qd  # dataclasses look their module up there
_spec.loader.exec_module(qd)

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
    kc, vc = qd.kv_hook(qd.KVConfig("c", center="kv"), shift)(0, k, v)
    torch.testing.assert_close((kc, vc), (k, v))
    # and the centers are taken out before quantizing: the error shrinks with the quantized norm
    mean = {0: (k.mean(2, keepdim=True) + 5, v.mean(2, keepdim=True))}
    plain = qd.kv_hook(qd.KVConfig("p", k=3))(0, k + 5, v)[0]
    centered = qd.kv_hook(qd.KVConfig("c", k=3, center="k"), mean)(0, k + 5, v)[0]
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
