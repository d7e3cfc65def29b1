import pytest
import torch

from tests.conftest import DEVICE
from tests.kernels.cases import make_paged_batch, skip_if_refused
from turboquant_vllm.core.presets import PRESETS
from turboquant_vllm.core.reference import read_kv_reference, store_kv_reference
from turboquant_vllm.kernels import dequantize_pages


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (96, 32), (128, 16), (256, 32)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_matches_reference(preset, head_dim, block_size, dtype):
    skip_if_refused(preset, head_dim)
    gen = torch.Generator().manual_seed(head_dim + block_size)
    seq_lens = [70, 1, 33]
    b = make_paged_batch(gen, preset, head_dim, 2, block_size, seq_lens, dtype, DEVICE)
    store_kv_reference(b.keys, b.values, b.kv_cache, b.slot_mapping, b.layout)
    cu = torch.tensor([0, 70, 71, 104], dtype=torch.int32, device=DEVICE)
    k, v = dequantize_pages(b.kv_cache, b.layout, b.block_table, b.seq_lens, cu, 104, 70, dtype)
    for i, n in enumerate(seq_lens):
        k_ref, v_ref = read_kv_reference(b.kv_cache, b.block_table[i], n, b.layout, rotated=True)
        rows = slice(int(cu[i]), int(cu[i + 1]))
        # table values in fp16, products rounded to the output dtype
        tol = dict(rtol=1e-2, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=2e-3, atol=1e-4)
        torch.testing.assert_close(k[rows].float(), k_ref, **tol)
        torch.testing.assert_close(v[rows].float(), v_ref, **tol)
    assert not torch.isnan(k).any() and not torch.isnan(v).any()
