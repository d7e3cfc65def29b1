import pytest

from turboquant_vllm.core.layout import CacheLayout
from turboquant_vllm.core.presets import PRESETS, get_preset


def test_bytes_per_token_per_head_at_128():
    assert get_preset("tq4").bytes_per_token_per_head(128) == 136
    assert get_preset("tq3").bytes_per_token_per_head(128) == 104
    assert get_preset("k4v3").bytes_per_token_per_head(128) == 120
    assert get_preset("k3v2").bytes_per_token_per_head(128) == 88
    assert get_preset("tq4").capacity_vs_bf16(128) == pytest.approx(512 / 136)
    assert get_preset("tq3").capacity_vs_bf16(128) == pytest.approx(4.923, rel=1e-3)


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_layout_is_exact(name, head_dim, block_size):
    p = get_preset(name)
    lay = CacheLayout(p, head_dim, num_kv_heads=8, block_size=block_size)
    assert lay.head_page_bytes == block_size * p.bytes_per_token_per_head(head_dim)
    assert lay.page_bytes == 8 * lay.head_page_bytes
    assert lay.key_norm_offset % 4 == 0 and lay.value_norm_offset % 4 == 0
    assert lay.cache_shape(10) == (10, 8, lay.head_page_bytes)


def test_bad_input_names_constraint():
    with pytest.raises(ValueError, match="tq4"):
        get_preset("tq5")
    with pytest.raises(ValueError, match="multiple of 16"):
        CacheLayout(get_preset("tq4"), 72, 8, 16)
    with pytest.raises(ValueError, match="block_size"):
        CacheLayout(get_preset("tq4"), 128, 8, 6)
