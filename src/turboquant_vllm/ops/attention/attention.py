"""Paged attention straight over the compressed cache (decode, prefill, chunked prefill): the entry point.

Reference: naive.paged_attention_reference.

Attention runs in the rotated basis: q.k = ||k|| (R q).value[code_k] and
sum_j p_j v_j = R^T sum_j p_j ||v_j|| value[code_v,j]. ops.rotation rotates the queries once before and the
outputs once after (merging the splits there); the inner loop is load codes -> unpack -> table lookup -> MMA, with
the norms applied to the scores (keys) and to the exponents (values: log2 of the norm), never per element. 4-bit
keys decode to int8 (one byte permute per 4 codes; the codebook lies on an int8 grid: core.codebook.codebook) and
meet the queries' int8 hi / lo parts in exact integer MMAs; values decode to fp16.
Under a key calibration a negative key norm marks a key stored uncentered (core.calibration): its score is taken
with the norm's magnitude, minus its query's offset (ops.rotation.RotatedQuery.offset), one load per query row.

Two kernels: decode.py (one-warp programs of one query token each, every preset but 5-bit keys; a sequence of a
few query tokens, a speculative verification, runs as that many decodes) and general.py (tiles of query tokens,
all query heads of one KV head per program, so each compressed byte is read once per KV head). Both split the
context when launch.py says so and write partials to the workspace; which kernel, how many warps, stages, registers
and splits is decided in launch.py alone.
"""

from __future__ import annotations

import torch

from ...core.calibration import KeyCalibration
from ...core.layout import CacheLayout
from ..constants import kernel_constants
from ..rotation import RotatedQuery, merge_and_unrotate, rotate_queries
from ..utils import INTERPRETED, check_cache, check_calibration, check_dtype, check_index, next_pow2, page_constants
from .decode import _decode_kernel
from .general import _attention_kernel
from .launch import (
    GENERAL_LAUNCH,
    MAX_DECODE_QUERY_LEN,
    attention_workspace_shape,
    decode_launch,
    decode_head_split,
    decode_merge_rows,
    decode_min_split_tokens,
    decode_num_splits,
    num_sms,
    per_warp_decode,
)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: CacheLayout,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    max_query_len: int,
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None = None,
    softcap: float | None = None,
    workspace: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    key_calibration: KeyCalibration | None = None,
    max_registers: int | None = None,
    min_split_tokens: int | None = None,
    head_split: int | None = None,
    merge_rows: int | None = None,
    rotated_query: RotatedQuery | None = None,
    batch_invariant: bool = False,
    decode: bool | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Causal attention of query (tokens, q_heads, head_dim) over the compressed pages, into out;
    key_calibration: the one the pages' keys were stored with (see core.calibration); num_splits, block_n,
    num_warps, num_stages, max_registers (per thread, 0: the compiler's choice), min_split_tokens (the decode
    kernel's least tokens a split), merge_rows (rows a merge program takes: ops.rotation.merge_and_unrotate; 0: its
    spread merge): None takes the launch policy's choice (launch.py) for decode, the general kernel's otherwise.
    head_split: decode programs a KV head's query heads are dealt to (the decode kernel only; None: the policy's).
    rotated_query: the query already in the cache's basis (and its offsets under the key calibration), as
    store_kv(..., query=query, query_scale=scale) returns it with the step's keys (one launch fewer).
    batch_invariant: every row computed as the general kernel computes it at one split, whatever the query length
    and the batch (decodes too): a row's output then depends on its own query and context only (vLLM's
    batch-invariant mode). decode: run every query token as a decode of its own causal prefix (None: when
    max_query_len is 1); with up to MAX_DECODE_QUERY_LEN tokens a sequence (speculative verification), each row then
    equals what decoding its position computes at the same split count.
    validate=False: the caller has checked kv_cache against layout already (the vLLM backend, once per forward)."""
    num_tokens, num_q_heads, head_dim = query.shape
    check_dtype("query", query)
    if validate:
        check_cache(kv_cache, layout)
    if head_dim != layout.head_dim:
        raise ValueError(f"query head_dim {head_dim} does not match the cache layout's {layout.head_dim}")
    if num_q_heads % layout.num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {layout.num_kv_heads} KV heads")
    if out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"out must match query: {tuple(query.shape)} {query.dtype}")
    for name, t in (("block_table", block_table), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        check_index(name, t, query)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_table.shape[0] < num_seqs:
        raise ValueError("query_start_loc needs num_seqs + 1 entries and block_table a row per sequence")
    if num_tokens == 0:
        return out
    group = num_q_heads // layout.num_kv_heads
    g_pad = next_pow2(group)
    if decode and max_query_len > MAX_DECODE_QUERY_LEN:
        raise ValueError(f"decode runs up to {MAX_DECODE_QUERY_LEN} query tokens a sequence, got {max_query_len}")
    decode = (max_query_len == 1 if decode is None else decode) and not batch_invariant
    if batch_invariant and num_splits not in (None, 1):
        raise ValueError(f"batch_invariant attention runs at one split, got num_splits={num_splits}")
    per_warp = decode and per_warp_decode(layout.preset)
    if head_split is None:
        head_split = decode_head_split(num_seqs, layout.preset, head_dim, group) if per_warp else 1
    if head_split != 1 and not (per_warp and head_split > 0 and not head_split & (head_split - 1)
                                and head_split <= g_pad // 8):
        raise ValueError(f"head_split {head_split}: the decode kernel deals a KV head's {g_pad} padded query heads "
                         "to a power of two of programs, >= 8 heads each")
    # The general kernel's decode mode takes one query token a sequence; longer ones run its tiles of query tokens.
    decode_only = per_warp or decode and max_query_len == 1
    block_q = 1 if decode_only else max(1, 64 // g_pad)
    block_m = max(16, block_q * g_pad)
    launch = decode_launch(layout.preset, head_dim) if decode_only else GENERAL_LAUNCH
    num_warps = num_warps or launch.num_warps
    block_n = block_n or 32 * num_warps
    num_stages = num_stages or launch.num_stages
    max_registers = launch.max_registers if max_registers is None else max_registers
    if num_splits is None:
        # decode, not decode_only: 5-bit keys verify in the general kernel at the split count the backend passes
        num_splits = decode_num_splits(num_seqs, layout, num_sms(query.device)) if decode else 1
    need = attention_workspace_shape(num_tokens, num_q_heads, head_dim, num_splits)[0]
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=query.device)
    elif workspace.dtype != torch.float32 or workspace.numel() < need:
        raise ValueError(f"workspace must be float32 with >= {need} elements")
    rows = num_tokens * num_q_heads
    part_acc = workspace[: rows * num_splits * head_dim]
    part_ml = workspace[rows * num_splits * head_dim : need]

    if key_calibration is not None:
        check_calibration(key_calibration, layout)
    c = kernel_constants(layout, query.device)
    # MMA operands are fp16 whatever the model dtype (3 more mantissa bits than bf16, same speed), but for
    # 4-bit keys: int8 keys and int8 hi / lo parts of the queries (exact products, see the kernel).
    if rotated_query is None:
        rotated_query = rotate_queries(query, layout, scale, key_calibration, torch.float16, spread=not batch_invariant)
    q_rot, q_offset = rotated_query
    if q_rot.shape != query.shape or q_rot.dtype != torch.float16 or q_rot.stride(2) != 1:
        raise ValueError(f"rotated_query must be float16 of the query's shape {tuple(query.shape)}")
    if (q_offset is None) != (key_calibration is None) or q_offset is not None and (
            q_offset.shape != query.shape[:2] or q_offset.dtype != torch.float32 or not q_offset.is_contiguous()):
        raise ValueError("rotated_query must carry contiguous float32 offsets of shape (tokens, q_heads) exactly "
                         "when the keys are calibrated")
    constants = dict(page_constants(layout))
    if layout.preset.k_bits == 5:
        # Triton 3.6 miscompiles the general kernel's MMAs over 5-bit key tiles of 32 coordinate pairs (head_dim 64:
        # shared-memory addresses out of range, or wrong scores; compute-sanitizer in
        # benchmarks/results/tests/h100-k5-head-dim-64.log at commit 98a39d8): pad them to 64 pairs, the padding
        # masked to zero.
        constants["D_PAD"] = max(constants["D_PAD"], 128)
    common = dict(
        NUM_Q_HEADS=num_q_heads, GROUP=group, NUM_SPLITS=num_splits, **constants,
        USE_WINDOW=bool(sliding_window), USE_SOFTCAP=bool(softcap), CALIBRATED=key_calibration is not None,
        UPCAST=INTERPRETED,
        K_ASM="" if INTERPRETED else c.key_mma_asm, V_ASM="" if INTERPRETED else c.value_lookup_asm,
        num_warps=num_warps, num_stages=num_stages, **({"maxnreg": max_registers} if max_registers else {}),
    )
    k_table = c.key_int8 if layout.preset.k_bits == 4 else c.key_values[torch.float16]
    strides = (q_rot.stride(0), q_rot.stride(1), block_table.stride(0), kv_cache.stride(0), kv_cache.stride(1))
    if per_warp:
        _decode_kernel[(num_seqs * max_query_len, layout.num_kv_heads * head_split, num_splits)](
            q_rot, q_rot if q_offset is None else q_offset, kv_cache, block_table, query_start_loc, seq_lens, k_table,
            c.value_values[torch.float16], part_acc, part_ml, *strides, sliding_window or 0, float(softcap or 0.0),
            c.key_int8_step,
            ROWS=max(8, g_pad // head_split), HEAD_SPLIT=head_split, WARPS=num_warps, WARP_N=block_n // num_warps,
            QUERY_LEN=max_query_len, V_CHUNKS=2 if head_dim > 64 else 1,
            MIN_SPLIT_TOKENS=min_split_tokens or decode_min_split_tokens(num_seqs),
            **common,
        )
    else:
        grid_q = num_seqs if decode_only else num_tokens // block_q + num_seqs
        _attention_kernel[(grid_q, layout.num_kv_heads, num_splits)](
            q_rot, q_rot if q_offset is None else q_offset, kv_cache, block_table, query_start_loc, seq_lens, k_table,
            c.value_values[torch.float16], part_acc, part_ml, num_seqs, *strides, sliding_window or 0,
            float(softcap or 0.0), c.key_int8_step,
            G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, DECODE_ONLY=decode_only,
            **common,
        )
    if merge_rows is None and decode_only:
        merge_rows = decode_merge_rows(rows)
    return merge_and_unrotate(part_acc, part_ml, num_splits, out, layout, merge_rows)
