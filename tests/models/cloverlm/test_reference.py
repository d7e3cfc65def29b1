"""CloverLM's plain-PyTorch reference (models.cloverlm.reference) and its checkpoints."""

import json

import pytest
import torch

from turboquant_vllm.models.cloverlm import reference as ref
from turboquant_vllm.models.cloverlm.checkpoint import config_of, read_checkpoint, write_checkpoint

SMALL = ref.CloverLMShape(vocab_size=97, num_blocks=2, heads=6, d_head=16, ratio=3, max_context=64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_epsilon_is_torchs_default(dtype):
    """The trained model's norms are torch.nn.RMSNorm(d), epsilon left to torch (bf16 norms when its linears are
    quantized): torch computes in fp32 with fp32's epsilon either way. Ours equals the module; 1e-6 would not."""
    assert ref.NORM_EPS == torch.finfo(torch.float32).eps
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 96, generator=gen) * 1e-3).to(dtype)  # rows of mean square ~1e-6, where epsilon shows
    module = torch.nn.RMSNorm(96).to(dtype)
    with torch.no_grad():
        module.weight.copy_(1 + torch.randn(96, generator=gen) * 0.1)
        theirs = module(x).float()
    ours = ref.rms_norm(x.float(), module.weight.float(), ref.NORM_EPS)
    torch.testing.assert_close(ours, theirs, rtol=1e-2, atol=1e-2)
    assert (ref.rms_norm(x.float(), module.weight.float(), 1e-6) - theirs).abs().max() > 0.1


def test_rope_turns_interleaved_pairs_by_relative_position():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    cos, sin = ref.rope_tables(torch.arange(40), 16)
    rq, rk = ref.apply_rope(q.expand(40, 16), cos, sin), ref.apply_rope(k.expand(40, 16), cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(40))
    torch.testing.assert_close(rq[30] @ rk[27], rq[10] @ rk[7])  # only the distance counts
    assert torch.equal(ref.apply_rope(q[None], *ref.rope_tables(torch.tensor([0]), 16))[0], q)
    # pair (0, 1) turns by position * 1024^0 = position radians; the last pair by position * 1024^(-14/16)
    one = ref.apply_rope(torch.tensor([1.0, 0.0] * 8)[None], *ref.rope_tables(torch.tensor([1]), 16))[0]
    torch.testing.assert_close(one[:2], torch.tensor([torch.cos(torch.tensor(1.0)), torch.sin(torch.tensor(1.0))]))
    angle = torch.tensor(1024.0 ** (-14 / 16))
    torch.testing.assert_close(one[14:], torch.stack((angle.cos(), angle.sin())))


def test_forward_is_causal_and_uses_every_block():
    w = ref.random_weights(SMALL, seed=2)
    ids = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(3))
    logits = ref.forward(w, SMALL, ids)
    assert logits.shape == (20, 97) and torch.isfinite(logits).all()
    changed = ids.clone()
    changed[12:] = (changed[12:] + 1) % 97
    torch.testing.assert_close(ref.forward(w, SMALL, changed)[:12], logits[:12])  # the past ignores the future
    w2 = dict(w)
    w2["transformer.blocks.1.mhsa.scale"] = w["transformer.blocks.1.mhsa.scale"] * 2
    assert not torch.allclose(ref.forward(w2, SMALL, ids), logits)  # the Q scale is the softmax's temperature


def test_kv_heads_are_shared_by_ratio_query_heads():
    """GQA: KV weights of heads / ratio heads; a model whose KV heads are copied per query head (ratio 1) gives the
    same logits."""
    w = ref.random_weights(SMALL, seed=4)
    assert w["transformer.blocks.0.mhsa.lk.weight"].shape == (2 * 16, 96)
    full = ref.CloverLMShape(97, 2, 6, 16, 1, 64)
    wf = dict(w)
    for i in range(2):
        for name in ("lk", "lv"):
            kv = w[f"transformer.blocks.{i}.mhsa.{name}.weight"].view(2, 16, 96)
            wf[f"transformer.blocks.{i}.mhsa.{name}.weight"] = kv.repeat_interleave(3, dim=0).reshape(96, 96)
    ids = torch.arange(15) % 97
    torch.testing.assert_close(ref.forward(wf, full, ids), ref.forward(w, SMALL, ids))


def test_checkpoint_round_trip(tmp_path):
    w = ref.random_weights(SMALL, seed=5)
    out = write_checkpoint(SMALL, w, tmp_path / "cloverlm-small")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "cloverlm" and config["num_key_value_heads"] == 2
    assert config["intermediate_size"] == 4 * 96 and config == config_of(SMALL)
    shape, got = read_checkpoint(out)
    assert shape == SMALL and "transformer.linear.weight" not in got  # tied: the embedding is the head
    assert all(torch.equal(got[k], v) for k, v in w.items())
    untied = ref.CloverLMShape(97, 1, 6, 16, 3, 64, weight_tying=False)
    _, got = read_checkpoint(write_checkpoint(untied, ref.random_weights(untied), tmp_path / "untied"))
    assert "transformer.linear.weight" in got


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of ratio"):
        ref.CloverLMShape(10, 1, 5, 16, 3, 8)
