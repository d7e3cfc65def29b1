"""key_centering's per-layer configurations: the parser and the bytes a configuration costs."""

import pytest

from benchmarks import key_centering as kc

BASE = "tq4 centered per token"


def test_per_layer_overrides_ranges_and_top_n():
    base = kc.CONFIGS[BASE]
    layers = kc.parse(f"{BASE} + k5 layers 0,2-3", 6)
    assert [layers[i][0] for i in range(6)] == [5, base[0], 5, 5, base[0], base[0]]
    assert all(layers[i][1:] == base[1:] for i in (0, 2, 3))  # values and centering stay the base's
    top = kc.parse(f"{BASE} + k5 layers top2", 6, ranking=[4, 1, 0, 2, 3, 5])
    assert sorted(i for i, v in top.items() if v[0] == 5) == [1, 4]
    assert kc.parse(f"{BASE} + bf16 layers 5", 6)[5][:2] == ("bf16", "bf16")
    with pytest.raises(ValueError, match="ranking"):
        kc.parse(f"{BASE} + k5 layers top2", 6)


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
