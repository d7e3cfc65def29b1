"""key_centering's per-layer configurations: the parser and the bytes a configuration costs."""

import pytest
import torch

from benchmarks import key_centering as kc

BASE = "tq4 centered per token"


def test_per_layer_overrides_ranges_and_top_n():
    base = kc.CONFIGS[BASE]
    layers = kc.parse(f"{BASE} + k5 layers 0,2-3", 6)
    assert [layers[i][0] for i in range(6)] == [5, base[0], 5, 5, base[0], base[0]]
    assert all(layers[i][1:] == base[1:] for i in (0, 2, 3))  # values and centering stay the base's
    top = kc.parse(f"{BASE} + k5 layers top2", 6, rankings={"k5": [4, 1, 0, 2, 3, 5]})
    assert sorted(i for i, v in top.items() if v[0] == 5) == [1, 4]
    assert kc.parse(f"{BASE} + bf16 layers 5", 6)[5][:2] == ("bf16", "bf16")
    with pytest.raises(ValueError, match="ranking"):
        kc.parse(f"{BASE} + k5 layers top2", 6)


def test_each_override_takes_its_own_ranking_and_later_parts_win():
    rankings = {"k4": [5, 0, 1, 2, 3, 4], "bf16": [2, 5, 0, 1, 3, 4]}
    layers = kc.parse("k5v4 centered per token + k4 layers top2 + bf16 layers top2", 6, rankings)
    assert layers[0] == kc.CONFIGS[BASE]  # 4-bit keys on a k5v4 base: tq4, calibrated
    assert layers[2][:2] == layers[5][:2] == ("bf16", "bf16")  # layer 5 in both: the later part's
    assert [layers[i] for i in (1, 3, 4)] == [kc.CONFIGS["k5v4 centered per token"]] * 3
    # k5v4 in 29 layers of 30 and bf16 in one: 86 B; two bf16 layers fit 90 B with 7 tq4 ones
    assert kc.bytes_per_token(kc.parse("k5v4 centered per token + bf16 layers 3", 30), 64) == pytest.approx(
        (29 * 80 + 256) / 30)
    assert kc.bytes_per_token(kc.parse("k5v4 centered per token + k4 layers 0-6 + bf16 layers 7,8", 30), 64) <= 90


def test_rankings_of_per_layer_kl():
    rows = [{"layer": 0, "k4": 3e-4, "k5": 1e-4, "k5v4": 9e-4, "gain": 2e-4},
            {"layer": 1, "k4": 5e-4, "k5": 1e-4, "k5v4": 2e-4, "gain": 4e-4},
            {"layer": 2, "k4": 2e-4, "k5": 1e-4, "k5v4": 5e-4, "gain": 1e-4}]
    assert kc.rankings_of(rows) == {"k5": [1, 0, 2], "k4": [2, 0, 1], "bf16": [0, 2, 1]}


def test_key_bits_per_layer_measures_each_layer_alone():
    torch.manual_seed(0)
    model = kc.Llama(kc.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=32)).eval()
    with torch.no_grad():  # sharper attention than the init's, so that the cache's error reaches the logits
        for name, w in model.named_parameters():
            if "self_attn" in name:
                w.mul_(10)
    ids = torch.randint(0, 64, (1, 16))
    d = torch.ones(1, 1, 1, 32)
    rows = kc.key_bits_per_layer(model, ids, {i: (0 * d, d, d) for i in range(2)}, log=lambda s: None)
    assert [r["layer"] for r in rows] == [0, 1] and all(set(r) == {"layer", *kc.LAYER_ALONE, "gain"} for r in rows)
    assert all(r["k4"] > r["k5"] > 0 and r["k5v4"] > 0 and r["gain"] == r["k4"] - r["k5"] for r in rows)


def test_bytes_per_token_average_the_layers():
    d = 64
    plain = kc.bytes_per_token(kc.parse(BASE, 30), d)
    assert plain == 72.0  # tq4 at head_dim 64
    assert kc.bytes_per_token(kc.parse(f"{BASE} + k5 layers 0-29", 30), d) == 80.0
    assert kc.bytes_per_token(kc.parse(f"{BASE} + bf16 layers 0,1,28,29", 30), d) == pytest.approx(
        (26 * 72 + 4 * 256) / 30)


def test_exact_first_keys_are_a_count_beside_the_layers():
    assert kc.exact_keys(BASE) == 0 and kc.exact_keys(f"{BASE} + sink key exact + k5 layers 3") == 1
    assert kc.exact_keys(f"{BASE} + first 4 keys exact") == 4
    layers = kc.parse(f"{BASE} + sink key exact + k5 layers 3", 6)
    assert layers == kc.parse(f"{BASE} + k5 layers 3", 6)  # the layers' bits are untouched
    assert kc.bytes_per_token(kc.parse(f"{BASE} + sink key exact", 30), 64) == 72.0  # per sequence, not per token
    assert kc.parse(f"{BASE} + first 4 keys exact", 6) == kc.parse(BASE, 6)


def test_key_bits_by_channel_parse_into_groups_and_count_their_norms():
    name = f"{BASE} + key bits by channel 5x24,4x16,3x24"
    groups = ((5, 24), (4, 16), (3, 24))
    assert kc.layers_of_base(name) == (groups, *kc.CONFIGS[BASE][1:])
    assert kc.parse(f"{name} + sink key exact", 3) == dict.fromkeys(range(3), kc.layers_of_base(name))
    assert kc.parse(f"{name} + k5 layers 1", 3)[1][0] == 5  # a layer override replaces the groups
    # 32 B of codes as tq4's, its fp32 norm, 2 fp16 norms for the 2 extra groups; values tq4 (36 B)
    assert kc.bytes_per_token(kc.parse(name, 30), 64) == 72.0 + 4


def test_channel_order_keeps_rope_pairs_together_by_weight():
    x = torch.tensor([[1.0, 5.0, 2.0, 0.5, 1.0, 0.0, 2.5, 9.0]])  # pairs (0,4) 2.0, (1,5) 5.0, (2,6) 4.5, (3,7) 9.5
    assert kc.channel_order(x).tolist() == [[3, 7, 1, 5, 2, 6, 0, 4]]


def test_grouped_fake_quant_quantizes_each_group_on_its_own():
    x, order = torch.randn(2, 3, 64), kc.channel_order(torch.rand(64))
    groups = ((5, 24), (4, 16), (3, 24))
    got = kc.fake_quant(x, groups, order)
    for start, (b, n) in zip((0, 24, 40), groups):
        idx = order[start:start + n]
        torch.testing.assert_close(got[..., idx], kc.fake_quant(x[..., idx], b))


def test_predicted_gain_of_bits_by_channel():
    flat = torch.ones(64, dtype=torch.float64)
    assert kc.predicted_gain(flat).item() == pytest.approx(1.0)
    skewed = torch.cat([torch.full((32,), 4.0), torch.ones(32)]).double()
    assert kc.predicted_gain(skewed).item() == pytest.approx((2.5 / 2.0) ** 2)  # (AM / GM)^2
    assert kc.predicted_gain(torch.stack([flat, skewed]), ((4, 64),)).tolist() == pytest.approx([1.0, 1.0])
    # equal x: spreading the bits unevenly only loses; skewed x: more bits where x is large gain
    assert kc.predicted_gain(flat, ((5, 32), (3, 32))).item() < 1.0
    assert kc.predicted_gain(torch.cat([skewed[:16], skewed[32:48], skewed[16:32], skewed[48:]]),
                             ((5, 32), (3, 32))).item() > 1.0
