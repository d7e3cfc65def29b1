import math
import random
from itertools import accumulate

import pytest
import torch

from tests.conftest import DEVICE, FULL_MATRIX
from tests.ops.cases import keys_with_sinks, make_paged_batch, random_calibration
from turboquant_vllm.core.presets import PRESETS
from turboquant_vllm.ops import attention_workspace_shape, paged_attention, store_kv
from turboquant_vllm.ops.attention.launch import per_warp_decode
from turboquant_vllm.ops.attention.naive import paged_attention_reference
from turboquant_vllm.ops.rotation import RotatedQuery
from turboquant_vllm.ops.store.naive import store_kv_reference

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3}
NUM_CASES = 240 if FULL_MATRIX else 30
MAX_CONTEXT = 10_000 if FULL_MATRIX else 300


def draw_case(i: int) -> dict:
    """Case i of the randomized matrix: every axis cycles so each value appears many times."""
    rng = random.Random(i)
    mode = ["decode", "prefill", "chunked", "mixed"][i % 4]
    num_seqs = rng.choice([1, 2, 3, 5]) if mode != "decode" else rng.choice([1, 3, 8])
    seq_lens, q_lens = [], []
    for s in range(num_seqs):
        n = rng.randint(1, MAX_CONTEXT) if rng.random() < 0.3 else rng.randint(1, min(MAX_CONTEXT, 700))
        kind = mode if mode != "mixed" else ["decode", "prefill", "chunked"][s % 3]
        q = {"decode": 1, "prefill": n, "chunked": rng.randint(1, n)}[kind]
        if kind == "prefill" and n > 2000:  # keep long prefills affordable: a long chunk instead
            q = rng.randint(1, 2000)
        seq_lens.append(n)
        q_lens.append(q)
    preset = list(PRESETS)[i % len(PRESETS)]
    head_dim = [64, 96, 128, 256][(i // 8) % 4]
    return dict(
        dtype=[torch.bfloat16, torch.float16][(i // 4) % 2],
        head_dim=head_dim,
        group=[1, 4, 8][i % 3],
        kv_heads=rng.choice([1, 2]),
        block_size=[16, 32][(i // 2) % 2],
        preset=preset,
        seq_lens=seq_lens,
        q_lens=q_lens,
        window=rng.choice([None] * 4 + [rng.randint(1, 300)]),
        softcap=rng.choice([None] * 4 + [rng.uniform(5, 50)]),
        num_splits=rng.choice([None, None, 1, 3, 8]),
        calibrated=i % 5 == 2,
    )


def run_case(case, seed):
    gen = torch.Generator().manual_seed(seed)
    b = make_paged_batch(gen, case["preset"], case["head_dim"], case["kv_heads"], case["block_size"],
                         case["seq_lens"], case["dtype"], DEVICE)
    cal = random_calibration(gen, case["kv_heads"], case["head_dim"], DEVICE) if case["calibrated"] else None
    if cal is not None:  # each sequence's first token a sink: stored uncentered, among centered keys
        b.keys = keys_with_sinks(gen, b.keys, cal, [0, *accumulate(case["seq_lens"][:-1])])
    store_kv_reference(b.keys, b.values, b.kv_cache, b.slot_mapping, b.layout, cal)
    q_lens = case["q_lens"]
    qsl = torch.tensor([0] + list(accumulate(q_lens)), dtype=torch.int32, device=DEVICE)
    n_q = sum(q_lens)
    q_heads = case["kv_heads"] * case["group"]
    query = torch.randn(n_q, q_heads, case["head_dim"], generator=gen).to(case["dtype"]).to(DEVICE)
    scale = 1 / math.sqrt(case["head_dim"])
    out = torch.full_like(query, float("nan"))
    paged_attention(query, b.kv_cache, b.layout, b.block_table, qsl, b.seq_lens, max_query_len=max(q_lens),
                    scale=scale, out=out, sliding_window=case["window"], softcap=case["softcap"],
                    num_splits=case["num_splits"], key_calibration=cal)
    ref = paged_attention_reference(query, b.kv_cache, b.layout, b.block_table, qsl, b.seq_lens, scale,
                                    case["window"], case["softcap"], cal)
    return out, ref


# every mode, preset, head dim, dtype and GQA width, a window, a soft-cap and a calibration, in ~25 s interpreted
@pytest.mark.matrix(fast=[0, 3, 4, 6, 10, 12, 15, 16, 19, 21, 22, 24])
@pytest.mark.parametrize("i", range(NUM_CASES))
def test_attention_matches_reference(i):
    case = draw_case(i)
    out, ref = run_case(case, seed=1000 + i)
    assert not torch.isnan(out).any(), "output not fully written (or NaN produced)"
    rel = (torch.linalg.vector_norm(out.float() - ref) / torch.linalg.vector_norm(ref)).item()
    assert rel < TOLERANCE[case["dtype"]], f"relative error {rel:.2e} for {case}"


@pytest.mark.matrix(fast=[0, 1, 5, 6])
@pytest.mark.parametrize("i", range(30 if FULL_MATRIX else 8))
def test_decode_kernel_matches_reference(i):
    """Decode has its own kernel (one online softmax per warp): every preset, head dim and GQA width, both dtypes,
    block sizes, windows, soft-caps, split counts and the calibration, with ragged context lengths."""
    rng = random.Random(7000 + i)
    num_seqs = rng.choice([1, 3, 8])
    seq_lens = [rng.randint(1, MAX_CONTEXT if rng.random() < 0.3 else min(MAX_CONTEXT, 700)) for _ in range(num_seqs)]
    preset, head_dim = list(PRESETS)[i % len(PRESETS)], [64, 96, 128, 256][(i // 2) % 4]
    case = dict(
        preset=preset, dtype=[torch.bfloat16, torch.float16][(i // 6) % 2],
        head_dim=head_dim,
        group=[1, 4, 8, 16, 2][i % 5], kv_heads=rng.choice([1, 2]), block_size=[16, 32][(i // 3) % 2],
        seq_lens=seq_lens, q_lens=[1] * num_seqs, window=[None, None, rng.randint(1, 300)][i % 3],
        softcap=[None, rng.uniform(5, 50)][(i // 4) % 2], num_splits=[None, 1, 3, 64][i % 4], calibrated=i % 3 == 1,
    )
    out, ref = run_case(case, seed=7000 + i)
    assert not torch.isnan(out).any(), "output not fully written (or NaN produced)"
    rel = (torch.linalg.vector_norm(out.float() - ref) / torch.linalg.vector_norm(ref)).item()
    assert rel < TOLERANCE[case["dtype"]], f"relative error {rel:.2e} for {case}"


@pytest.mark.matrix(fast=["decode-6"])
@pytest.mark.parametrize("group", [3, 5, 6, 7])
@pytest.mark.parametrize("mode", ["decode", "chunked"])
def test_groups_that_are_not_powers_of_two(group, mode):
    """Query-head groups of 3, 5, 6 and 7 (SmolLM2, Llama-3.2-3B, Qwen2.5): the rows that pad the group to a power
    of two are computed and dropped, never written."""
    rng = random.Random(group * 10 + len(mode))
    seq_lens = [rng.randint(1, 300) for _ in range(3)]
    case = dict(
        preset=["tq4", "tq3", "k4v3", "tq2"][group % 4], dtype=[torch.bfloat16, torch.float16][group % 2],
        head_dim=[64, 96, 128, 256][(group + len(mode)) % 4], group=group, kv_heads=2, block_size=16,
        seq_lens=seq_lens, q_lens=[1] * 3 if mode == "decode" else [rng.randint(1, n) for n in seq_lens],
        window=None, softcap=None, num_splits=None, calibrated=group == 5,
    )
    out, ref = run_case(case, seed=9000 + group)
    assert not torch.isnan(out).any(), "output not fully written (or NaN produced)"
    rel = (torch.linalg.vector_norm(out.float() - ref) / torch.linalg.vector_norm(ref)).item()
    assert rel < TOLERANCE[case["dtype"]], f"relative error {rel:.2e} for {case}"


@pytest.mark.matrix(fast=["64-k5v4"])
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_calibrated_sinks_match_reference(preset, head_dim):
    """Calibrated keys of both kinds in every sequence (its first token a sink, stored uncentered; the rest
    centered), written by the store kernel: a decode step whose store launch rotates the queries (and their offsets),
    then a chunked prefill over the same pages, match the reference."""
    gen = torch.Generator().manual_seed(hash((preset, head_dim, "sinks")) % 2**31)
    # two and three pages (first tokens 0 and 20); interpreted, a decode of 2 splits (the policy's 32 are 31 empty
    # programs a sequence and KV head here)
    seq_lens, splits = ([45, 70], None) if FULL_MATRIX else ([20, 40], 2)
    total = sum(seq_lens)
    b = make_paged_batch(gen, preset, head_dim, 2, 16, seq_lens, torch.bfloat16, DEVICE)
    cal = random_calibration(gen, 2, head_dim, DEVICE)
    b.keys = keys_with_sinks(gen, b.keys, cal, [0, seq_lens[0]])
    last = torch.tensor([seq_lens[0] - 1, total - 1], device=DEVICE)
    context = torch.ones(total, dtype=torch.bool, device=DEVICE)
    context[last] = False
    store_kv(b.keys[context], b.values[context], b.kv_cache, b.slot_mapping[context], b.layout, cal)
    norms = b.kv_cache[:, :, b.layout.key_norm_offset : b.layout.value_code_offset].contiguous().view(torch.float32)
    assert (norms < 0).any() and (norms > 0).any()
    scale = head_dim**-0.5
    for q_lens in ([1, 1], [10, 30]):
        query = torch.randn(sum(q_lens), 8, head_dim, generator=gen).to(torch.bfloat16).to(DEVICE)
        qsl = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=DEVICE)
        rotated = None
        if q_lens == [1, 1]:  # this step's keys go in with the queries, as vLLM's decode steps
            rotated = store_kv(b.keys[last], b.values[last], b.kv_cache, b.slot_mapping[last], b.layout, cal,
                               query=query, query_scale=scale)
        out = torch.full_like(query, float("nan"))
        paged_attention(query, b.kv_cache, b.layout, b.block_table, qsl, b.seq_lens, max_query_len=max(q_lens),
                        scale=scale, out=out, key_calibration=cal, rotated_query=rotated,
                        num_splits=splits if q_lens == [1, 1] else None)
        ref = paged_attention_reference(query, b.kv_cache, b.layout, b.block_table, qsl, b.seq_lens, scale,
                                        key_calibration=cal)
        assert not torch.isnan(out).any()
        rel = (torch.linalg.vector_norm(out.float() - ref) / torch.linalg.vector_norm(ref)).item()
        assert rel < TOLERANCE[torch.bfloat16], f"relative error {rel:.2e} for q_lens {q_lens}"


def test_matrix_covers_the_axes():
    cases = [draw_case(i) for i in range(NUM_CASES)]
    for key, wanted in [("head_dim", {64, 96, 128, 256}), ("group", {1, 4, 8}), ("block_size", {16, 32}),
                        ("dtype", {torch.float16, torch.bfloat16}), ("preset", set(PRESETS)),
                        ("calibrated", {False, True})]:
        assert {c[key] for c in cases} == wanted, key
    assert max(max(c["seq_lens"]) for c in cases) > MAX_CONTEXT // 2


def test_workspace_is_caller_provided():
    case = dict(draw_case(0), num_splits=4, q_lens=[1, 1], seq_lens=[50, 70])
    gen = torch.Generator().manual_seed(5)
    b = make_paged_batch(gen, "tq4", 64, 2, 16, case["seq_lens"], torch.float16, DEVICE)
    store_kv_reference(b.keys, b.values, b.kv_cache, b.slot_mapping, b.layout)
    q = torch.randn(2, 8, 64, generator=gen).half().to(DEVICE)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    ws = torch.empty(attention_workspace_shape(2, 8, 64, 4), dtype=torch.float32, device=DEVICE)
    out = torch.empty_like(q)
    args = (q, b.kv_cache, b.layout, b.block_table, qsl, b.seq_lens)
    paged_attention(*args, max_query_len=1, scale=0.125, out=out, workspace=ws, num_splits=4)
    ref = paged_attention_reference(*args, 0.125)
    assert (out.float() - ref).norm() / ref.norm() < 5e-3
    with pytest.raises(ValueError, match="workspace"):
        paged_attention(*args, max_query_len=1, scale=0.125, out=out, workspace=ws[:10], num_splits=4)
    out.fill_(float("nan"))  # the launch options of kernel_variants: a split floor, merge programs of 3 rows
    paged_attention(*args, max_query_len=1, scale=0.125, out=out, workspace=ws, num_splits=4, min_split_tokens=32,
                    merge_rows=3)
    assert (out.float() - ref).norm() / ref.norm() < 5e-3
    # splits past the context are empty: their partials weigh nothing, so a workspace poisoned with NaN stays out of
    # the output
    ws8 = torch.full(attention_workspace_shape(2, 8, 64, 8), float("nan"), dtype=torch.float32, device=DEVICE)
    out.fill_(float("nan"))
    paged_attention(*args, max_query_len=1, scale=0.125, out=out, workspace=ws8, num_splits=8, min_split_tokens=32)
    assert (out.float() - ref).norm() / ref.norm() < 5e-3


@pytest.mark.matrix(fast=["tq4"])
@pytest.mark.parametrize("preset", ["tq4", "tq3"])
def test_decode_deals_query_heads_to_programs(preset):
    """head_split: a group of 16 query heads decoded by two programs of 8 (a ragged group of 12: the second
    program's last 4 rows masked) equals the reference; a split leaving a program < 8 heads, or outside the decode
    kernel, is refused."""
    gen = torch.Generator().manual_seed(11)
    b = make_paged_batch(gen, preset, 64, 2, 16, [333, 70], torch.bfloat16, DEVICE)
    store_kv_reference(b.keys, b.values, b.kv_cache, b.slot_mapping, b.layout)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    for q_heads in (32, 24):
        q = torch.randn(2, q_heads, 64, generator=gen).bfloat16().to(DEVICE)
        args = (q, b.kv_cache, b.layout, b.block_table, qsl, b.seq_lens)
        ref = paged_attention_reference(*args, 0.125)
        out = torch.full_like(q, float("nan"))
        paged_attention(*args, max_query_len=1, scale=0.125, out=out, num_splits=3, min_split_tokens=64,
                        head_split=2)
        assert not torch.isnan(out).any()
        assert (out.float() - ref).norm() / ref.norm() < TOLERANCE[torch.bfloat16]
    q = torch.randn(2, 16, 64, generator=gen).bfloat16().to(DEVICE)
    args = (q, b.kv_cache, b.layout, b.block_table, qsl, b.seq_lens)
    with pytest.raises(ValueError, match="head_split"):  # a group of 8: one program of 8 already
        paged_attention(*args, max_query_len=1, scale=0.125, out=torch.empty_like(q), head_split=2)
    with pytest.raises(ValueError, match="head_split"):  # a prefill runs the general kernel
        paged_attention(*args, max_query_len=1, scale=0.125, out=torch.empty_like(q), head_split=2, decode=False)


@pytest.mark.matrix(fast=["1-tq4-dtype0", "1-tq3-dtype1"])
@pytest.mark.parametrize("preset,dtype", [("tq4", torch.bfloat16), ("tq3", torch.float16)])
@pytest.mark.parametrize("q_len", [1, 40])
def test_value_norms_from_zero_past_the_fp16_range(preset, dtype, q_len):
    """Value norms enter the kernel's exponent (log2 of the norm): zero vectors keep their softmax weight and
    norms past fp16's 65504 neither overflow nor swamp the small ones. Checked per output row: a kernel that
    scaled p * norm by the tile's largest norm into fp16 erred up to 0.59 on rows led by a small-norm token."""
    gen = torch.Generator().manual_seed(7)
    b = make_paged_batch(gen, preset, 128, 2, 16, [300, 77], dtype, DEVICE)
    spread = 10.0 ** torch.empty(b.values.shape[0], 2, 1).uniform_(-4, 3.5, generator=gen)
    spread[::7] = 0.0  # every 7th token's values are exactly zero
    values = (b.values.float().cpu() * spread).to(dtype).to(DEVICE)
    store_kv_reference(b.keys, values, b.kv_cache, b.slot_mapping, b.layout)
    qsl = torch.tensor([0, q_len, 2 * q_len], dtype=torch.int32, device=DEVICE)
    q = (torch.randn(2 * q_len, 8, 128, generator=gen) * 2).to(dtype).to(DEVICE)
    args = (q, b.kv_cache, b.layout, b.block_table, qsl, b.seq_lens)
    out = torch.full_like(q, float("nan"))
    paged_attention(*args, max_query_len=q_len, scale=128**-0.5, out=out, num_splits=None if q_len > 1 else 3)
    ref = paged_attention_reference(*args, 128**-0.5)
    assert not torch.isnan(out).any() and not torch.isinf(out).any()
    assert ((out.float() - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 2e-2


def test_rejects_bad_input():
    gen = torch.Generator().manual_seed(6)
    b = make_paged_batch(gen, "tq4", 64, 2, 16, [10], torch.float16, DEVICE)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, 3, 64).half().to(DEVICE)
    with pytest.raises(ValueError, match="multiple of 2 KV heads"):
        paged_attention(q, b.kv_cache, b.layout, b.block_table, qsl, b.seq_lens, max_query_len=1, scale=1.0,
                        out=torch.empty_like(q))
    q = torch.randn(1, 2, 64).half().to(DEVICE)
    with pytest.raises(ValueError, match="seq_lens must be torch.int32"):
        paged_attention(q, b.kv_cache, b.layout, b.block_table, qsl, b.seq_lens.long(), max_query_len=1, scale=1.0,
                        out=torch.empty_like(q))
    q = torch.randn(1, 2, 64).to(DEVICE)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        paged_attention(q, b.kv_cache, b.layout, b.block_table, qsl, b.seq_lens, max_query_len=1, scale=1.0,
                        out=torch.empty_like(q))
    q = torch.randn(1, 2, 64).half().to(DEVICE)
    cal = random_calibration(gen, 2, 64, DEVICE)
    with pytest.raises(ValueError, match="offsets"):  # queries rotated without the calibration's offsets
        paged_attention(q, b.kv_cache, b.layout, b.block_table, qsl, b.seq_lens, max_query_len=1, scale=1.0,
                        out=torch.empty_like(q), key_calibration=cal, rotated_query=RotatedQuery(q, None))


def test_decode_launch_only_where_it_was_measured_to_pay():
    """tq4 up to head_dim 128: one warp, loads two tiles ahead, 168 registers, ~6 programs per SM; the narrower
    presets and tq4 at 256: one tile ahead, 24 programs per SM (tq4 at 256: 4), 168 registers at head_dim 65..128
    only; k5v4 (the general kernel): 4 warps, 2 per SM (benchmarks/results/kernel_variants/ at commit 98a39d8,
    h200-decode-tables-stages-launch.log). One sequence: up to 64 splits in the per-warp kernel, 32 in the general
    one; more: 32, 16 for tq4 at 256 (h{100,200}-tq4-d256-split-count.md), of at least 128 tokens for one
    sequence, 256 for more (h100-tq4-one-sequence-split-floor-d*.md); up to 128 rows the spread merge
    (h100-one-sequence-kernels.log).
    """
    from turboquant_vllm.core.presets import get_preset
    from turboquant_vllm.ops.attention import AttentionLaunch, decode_launch
    from turboquant_vllm.core.layout import CacheLayout
    from turboquant_vllm.ops.attention.launch import (
        decode_head_split,
        decode_merge_rows,
        decode_min_split_tokens,
        decode_num_splits,
    )
    from turboquant_vllm.ops.rotation.rotation import SPREAD

    got = {(p, d): decode_launch(get_preset(p), d)
           for p in ("tq4", "k4v3", "tq3", "k3v2", "tq2", "k5v4") for d in (64, 96, 128, 256)}
    want = {(p, d): AttentionLaunch(4, 3, 0, 2) if p == "k5v4"
            else AttentionLaunch(1, 5, 168, 6, 64) if p == "tq4" and d <= 128
            else AttentionLaunch(1, 3, 0, 4, 64, 16) if p == "tq4"
            else AttentionLaunch(1, 3, 168 if d in (96, 128) else 0, 24, 64) for p, d in got}
    assert got == want
    assert [decode_merge_rows(r) for r in (1, 64, 128, 129, 4096)] == [SPREAD] * 3 + [None, None]
    assert [decode_min_split_tokens(n) for n in (1, 2, 64)] == [128, 256, 256]
    # one sequence: >= 512 programs over few KV heads (h100-tq4-one-sequence-splits-by-kv-heads-d*.md)
    tq4, tq3 = get_preset("tq4"), get_preset("tq3")
    splits = {(kv, n): decode_num_splits(n, CacheLayout(tq4, 128, kv, 16), sms=132) for kv in (1, 2, 3, 4, 8, 16)
              for n in (1, 2)}
    assert splits == {(1, 1): 256, (2, 1): 256, (3, 1): 256, (4, 1): 128, (8, 1): 64, (16, 1): 64,
                      (1, 2): 32, (2, 2): 32, (3, 2): 32, (4, 2): 32, (8, 2): 32, (16, 2): 32}
    assert decode_num_splits(1, CacheLayout(get_preset("k5v4"), 128, 2, 16), sms=132) == 32  # the general kernel
    # two programs a KV head: one sequence, tq4 at head_dim 256, groups over 8 (h100-tq4-head-split-group16-d256.md)
    assert [decode_head_split(n, tq4, 256, g) for n, g in ((1, 16), (1, 12), (1, 8), (2, 16))] == [2, 2, 1, 1]
    assert decode_head_split(1, tq4, 128, 16) == decode_head_split(1, tq3, 256, 16) == 1


@pytest.mark.matrix(fast=["k5v4-64-dtype4-None"])
@pytest.mark.parametrize("preset,head_dim,dtype,window", [
    ("tq4", 64, torch.bfloat16, None), ("tq3", 128, torch.float16, 7), ("k4v3", 96, torch.bfloat16, None),
    ("tq4", 256, torch.float16, 7), ("k5v4", 64, torch.float16, None)])
def test_verification_equals_decode_at_each_position(preset, head_dim, dtype, window):
    """A speculative verification (K + 1 queries a sequence, their keys stored in one launch with the fused query
    rotation, then attention with decode=True) gives each position exactly what decoding it would (its token stored,
    then a decode launch), bit for bit on the decode kernel; 5-bit keys (the general kernel's tiles) to well within
    the kernels' rounding. Short contexts, so one key too many or too few in the causal mask moves the output by
    percents; one sequence drafts fewer tokens (a shorter query, its slots past it empty)."""
    gen = torch.Generator().manual_seed(head_dim + len(preset))
    steps, seq_lens, group = 4, [4, 9, 23], 3
    drafted = [steps, steps, 2]  # query tokens of each sequence
    b = make_paged_batch(gen, preset, head_dim, 2, 16, seq_lens, dtype, DEVICE)
    starts = [0, *accumulate(seq_lens)]
    tail = [[starts[s + 1] - steps + i for s in range(len(seq_lens))] for i in range(steps)]  # step i's tokens
    prefix = torch.tensor(sorted(set(range(starts[-1])) - {t for row in tail for t in row}), dtype=torch.long)
    store_kv(b.keys[prefix], b.values[prefix], b.kv_cache, b.slot_mapping[prefix], b.layout)
    query = torch.randn(len(seq_lens), steps, 2 * group, head_dim, generator=gen).mul(3).to(dtype).to(DEVICE)
    scale = 1 / math.sqrt(head_dim)
    # Interpreted, 3 splits (the policy's 32 are empty programs past these contexts, 5 s a launch): both ways
    # split alike, as the backend passes its split count to both
    kw = dict(scale=scale, sliding_window=window, num_splits=None if FULL_MATRIX else 3)

    cache = b.kv_cache.clone()
    decoded = torch.full_like(query, float("nan"))
    one_each = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    for i, tokens in enumerate(tail):
        t = torch.tensor(tokens, device=DEVICE)
        q = query[:, i].contiguous()
        rotated = store_kv(b.keys[t], b.values[t], cache, b.slot_mapping[t], b.layout, query=q, query_scale=scale)
        lens = b.seq_lens - (steps - 1 - i)
        paged_attention(q, cache, b.layout, b.block_table, one_each, lens, max_query_len=1, out=decoded[:, i],
                        rotated_query=rotated, **kw)

    t = torch.tensor([tok for s in range(len(seq_lens)) for tok in (row[s] for row in tail)], device=DEVICE)
    flat = query.reshape(-1, 2 * group, head_dim)
    rotated = store_kv(b.keys[t], b.values[t], b.kv_cache, b.slot_mapping[t], b.layout, query=flat, query_scale=scale)
    assert torch.equal(b.kv_cache, cache), "the verification's keys stored differently from decoding's"
    # The last sequence verifies its first two positions only (its cache and seq_len as they were then).
    keep = [s * steps + i for s in range(len(seq_lens)) for i in range(drafted[s])]
    flat, rotated = flat[keep], RotatedQuery(rotated.query[keep], None)
    lens = b.seq_lens - torch.tensor([steps - n for n in drafted], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, *accumulate(drafted)], dtype=torch.int32, device=DEVICE)
    verified = torch.full_like(flat, float("nan"))
    paged_attention(flat, b.kv_cache, b.layout, b.block_table, qsl, lens, max_query_len=steps, out=verified,
                    rotated_query=rotated, decode=True, **kw)
    ref = paged_attention_reference(flat, b.kv_cache, b.layout, b.block_table, qsl, lens, scale, window)

    decoded = decoded.reshape(-1, 2 * group, head_dim)[keep]
    assert not torch.isnan(verified).any() and not torch.isnan(decoded).any()
    rel = lambda a, c: (torch.linalg.vector_norm(a.float() - c.float()) / torch.linalg.vector_norm(c.float())).item()  # noqa: E731
    if per_warp_decode(PRESETS[preset]):
        assert torch.equal(verified, decoded), (rel(verified, decoded), rel(verified, ref), rel(decoded, ref))
    else:
        assert rel(verified, decoded) < 3e-3, (rel(verified, decoded), rel(verified, ref), rel(decoded, ref))
    assert rel(verified, ref) < TOLERANCE[dtype] and rel(decoded, ref) < TOLERANCE[dtype]


def test_batch_invariant_rows_ignore_the_batch_and_the_query_length(monkeypatch):
    """batch_invariant=True: a decode row alone, beside other sequences, or as the last row of a four-token query gives
    the same bits; a split count other than one is refused. Its queries never take the rotation's spread kernel for
    few rows (the one kernel for any row count)."""
    from turboquant_vllm.ops.rotation import rotation

    def no_spread(*args, **kwargs):
        raise AssertionError("batch-invariant attention took the spread rotation")

    monkeypatch.setattr(rotation, "_spread_rotation", no_spread)
    gen = torch.Generator().manual_seed(11)
    b = make_paged_batch(gen, "tq4", 64, 2, 16, [40, 300], torch.bfloat16, DEVICE)
    store_kv_reference(b.keys, b.values, b.kv_cache, b.slot_mapping, b.layout)
    query = torch.randn(5, 6, 64, generator=gen).to(torch.bfloat16).to(DEVICE)  # 4 rows of sequence 0, 1 of 1
    kw = dict(scale=0.125, batch_invariant=True)

    def attend(q, rows, q_lens):
        qsl = torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=DEVICE)
        out = torch.full_like(q, float("nan"))
        paged_attention(q, b.kv_cache, b.layout, b.block_table[rows], qsl, b.seq_lens[rows],
                        max_query_len=max(q_lens), out=out, **kw)
        return out

    alone = attend(query[3:4], [0], [1])
    beside = attend(query[3:5], [0, 1], [1, 1])[:1]
    verified = attend(query, [0, 1], [4, 1])[3:4]
    # beside a 25-token query: 156 rows, past the rotation's spread kernel (ops.rotation.SPREAD_ROWS)
    crowd = torch.cat([query[3:4], torch.randn(25, 6, 64, generator=gen).to(torch.bfloat16).to(DEVICE)])
    crowded = attend(crowd, [0, 1], [1, 25])[:1]
    assert torch.equal(alone, beside) and torch.equal(alone, verified) and torch.equal(alone, crowded)
    with pytest.raises(ValueError, match="one split"):
        paged_attention(query[3:4], b.kv_cache, b.layout, b.block_table[:1],
                        torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), b.seq_lens[:1], max_query_len=1,
                        out=torch.empty_like(query[3:4]), num_splits=4, **kw)


def test_head_dim_256_split_counts_are_the_measured_best():
    """tq4 at head_dim 256, 8 KV heads, 132 SMs: the split counts that measured best or within 1% of it on the H200
    (kernel_variants/h200-tq4-d256-split-count.md): 16 x 2k 8, 8 x 32k and 2 x 8k 16, 64 x 8k 2; one sequence 64."""
    from turboquant_vllm.core.layout import CacheLayout
    from turboquant_vllm.core.presets import get_preset
    from turboquant_vllm.ops.attention import decode_num_splits

    layout = CacheLayout(get_preset("tq4"), 256, 8, 16)
    assert {n: decode_num_splits(n, layout, sms=132) for n in (1, 2, 8, 16, 64)} == {1: 64, 2: 16, 8: 16, 16: 8,
                                                                                     64: 2}
