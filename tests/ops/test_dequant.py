import pytest
import torch

from tests.conftest import DEVICE, FULL_MATRIX
from tests.ops.cases import keys_with_sinks, make_paged_batch, random_calibration
from turboquant_vllm.core.presets import PRESETS
from turboquant_vllm.ops import dequantize_pages
from turboquant_vllm.ops.dequant.naive import read_kv_reference
from turboquant_vllm.ops.store.naive import store_kv_reference


@pytest.mark.matrix
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (96, 32), (128, 16), (256, 32)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("calibrated", [False, True])
def test_dequantize_matches_reference(preset, head_dim, block_size, dtype, calibrated):
    gen = torch.Generator().manual_seed(hash((preset, head_dim, str(dtype), calibrated)) % 2**31)
    # several pages, a single token, a page and a part (interpreted: 64 tokens, not 104: ~40% fewer programs)
    seq_lens = [70, 1, 33] if FULL_MATRIX else [40, 1, 23]
    cu_list = [0, seq_lens[0], seq_lens[0] + 1, sum(seq_lens)]
    b = make_paged_batch(gen, preset, head_dim, 2, block_size, seq_lens, dtype, DEVICE)
    cal = random_calibration(gen, 2, head_dim, DEVICE) if calibrated else None
    if cal is not None:  # each sequence's first token a sink: stored uncentered, among centered ones
        b.keys = keys_with_sinks(gen, b.keys, cal, cu_list[:3])
    store_kv_reference(b.keys, b.values, b.kv_cache, b.slot_mapping, b.layout, cal)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=DEVICE)
    k, v = dequantize_pages(b.kv_cache, b.layout, b.block_table, b.seq_lens, cu, cu_list[-1], seq_lens[0], dtype, cal)
    assert k.dtype == v.dtype == dtype and not k.isnan().any() and not v.isnan().any()
    for i, n in enumerate(seq_lens):
        k_ref, v_ref = read_kv_reference(b.kv_cache, b.block_table[i], n, b.layout, key_calibration=cal)
        if cal is not None:  # ~ k - mean, centered or not: q . K is the calibrated score of every key
            k_ref = k_ref * cal.scale.to(k_ref.device)
        rows = slice(int(cu[i]), int(cu[i + 1]))
        # fp16 table values (2^-12), rotated back at ~fp32 accuracy, rounded to the output dtype; per row, since
        # the calibration's scale spreads a row's error unevenly over its elements
        tol = 5e-3 if dtype == torch.bfloat16 else 2e-3
        for ours, ref in ((k[rows], k_ref), (v[rows], v_ref)):
            err = (ours.float() - ref).norm(dim=-1) / ref.norm(dim=-1)
            assert err.max().item() < tol, f"worst row's relative error {err.max().item():.2e}"
