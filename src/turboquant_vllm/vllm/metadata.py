"""Attention metadata: the step's batch split into decodes and the rest, with the scratch each needs.

Decodes come first in a batch (vLLM reorders it for us) and run the decode kernel with a split count from
ops.attention.launch: query length 1, and under speculative decoding up to 1 + the drafted tokens (a verification
runs as that many decodes, each position computing what decoding it would). The rest (prefills, chunked-prefill
continuations) runs the general kernel, or, from DENSE_PREFILL_MIN_TOKENS prefill tokens, FlashAttention over the
expanded context. Uniform batches may be captured whole in a CUDA graph: they only reference persistent buffers
(query_start_loc, seq_lens, block table, the shared workspace) and their split count depends on the batch shape;
the dense path, which sizes itself from host-side lengths, never runs for a batch of that shape.
In vLLM's batch-invariant mode every query row, decodes included, runs the general kernel at one split (as a
verification's or a prefill chunk's rows do) and no batch takes the dense path: a row's attention then depends on
its own query and context only, not on its batch.
The scratch is one fp32 buffer from vLLM's workspace manager, shared by every layer, reserved at its maximum when
the first layer is built (before memory profiling and CUDA-graph capture).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..core.layout import CacheLayout
from ..ops.attention import MAX_DECODE_QUERY_LEN, attention_workspace_shape, decode_num_splits, num_sms
from . import compat
from .compat import (
    AttentionCGSupport,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    split_decodes_and_prefills,
)
from .kv_spec import check_builder_spec

# From this many prefill tokens in a step, expanding the context once and running FlashAttention
# beats re-decoding the compressed context for every tile of query tokens.
DENSE_PREFILL_MIN_TOKENS = 256


def workspace_elems(
    num_decode_tokens: int, num_prefill_tokens: int, splits: int, num_q_heads: int, head_dim: int
) -> int:
    """fp32 elements one step needs; the decode and the prefill launch run in turn and share them."""
    decode = attention_workspace_shape(num_decode_tokens, num_q_heads, head_dim, splits)[0]
    prefill = attention_workspace_shape(num_prefill_tokens, num_q_heads, head_dim, 1)[0]
    return max(decode, prefill)


@functools.lru_cache(maxsize=None)
def max_workspace_elems(num_q_heads: int, layout: CacheLayout, max_tokens: int, max_seqs: int, sms: int,
                        query_len: int = 1) -> int:
    """The most any step can need: a full prefill budget unsplit, or any decode batch split (up to query_len tokens
    a sequence)."""
    most = workspace_elems(0, max_tokens, 1, num_q_heads, layout.head_dim)
    for seqs in range(1, min(max_seqs, max_tokens) + 1):
        splits = decode_num_splits(seqs, layout, sms)
        tokens = min(seqs * query_len, max_tokens)
        most = max(most, workspace_elems(tokens, 0, splits, num_q_heads, layout.head_dim))
    return most


def decode_query_len(vllm_config: Any) -> int:
    """The longest query the decode kernel takes a sequence (vLLM's reorder threshold for this backend): 1, or under
    speculative decoding a verification's, as vLLM counts it (max_decode_query_len), up to
    ops.attention.MAX_DECODE_QUERY_LEN."""
    return min(compat.max_decode_query_len(vllm_config), MAX_DECODE_QUERY_LEN)


def reserve_workspace(vllm_config: Any, num_q_heads: int, layout: CacheLayout) -> int | None:
    """Grow vLLM's shared workspace to the maximum this backend can ask for; idempotent across layers."""
    manager = compat.workspace_manager()
    if manager is None or vllm_config is None:
        return None
    scheduler = vllm_config.scheduler_config
    max_tokens = max(
        scheduler.max_num_batched_tokens,
        getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", None) or 0,
    )
    elems = max_workspace_elems(num_q_heads, layout, max_tokens, scheduler.max_num_seqs, num_sms(),
                                decode_query_len(vllm_config))
    manager.get_simultaneous(((elems,), torch.float32))
    return elems


@dataclass
class TurboQuantMetadata(AttentionMetadata):
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # (num_reqs + 1,) int32
    seq_lens: torch.Tensor  # (num_reqs,) int32
    block_table: torch.Tensor  # (num_reqs, max_blocks) int32
    slot_mapping: torch.Tensor

    # Decodes come first: requests [0, num_decodes), tokens [0, num_decode_tokens).
    num_decodes: int
    num_decode_tokens: int
    decode_num_splits: int
    decode_query_len: int  # query slots a decode sequence: 1, or the builder's reorder threshold (verifications)
    # The rest: requests [num_decodes, num_reqs), tokens [num_decode_tokens, + num_prefill_tokens).
    num_prefills: int
    num_prefill_tokens: int
    prefill_max_query_len: int
    prefill_query_start_loc: torch.Tensor | None  # rebased to start at 0
    prefill_seq_lens: torch.Tensor | None
    prefill_block_table: torch.Tensor | None
    decode_query_start_loc: torch.Tensor | None
    decode_seq_lens: torch.Tensor | None
    decode_block_table: torch.Tensor | None

    batch_invariant: bool  # vLLM's batch-invariant mode: one kernel at one split for every row
    workspace: torch.Tensor | None  # view of vLLM's shared workspace (fp32), None without one

    # Long prefills: the prefill part's context, expanded once and attended by FlashAttention.
    prefill_cu_seqlens_k: torch.Tensor | None = None  # (num_prefills + 1,) int32, None: paged kernel
    prefill_total_k: int = 0
    prefill_max_seq_len: int = 0


class TurboQuantMetadataBuilder(AttentionMetadataBuilder[TurboQuantMetadata]):
    # Uniform batches (all decodes, or all speculative verifications of one length) may be
    # captured whole; mixed batches run attention eagerly between piecewise graphs.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        check_builder_spec(kv_cache_spec, layer_names)
        self.layout = kv_cache_spec.layout
        self.batch_invariant = compat.batch_invariant()
        self.dense_prefill = compat.flash_attn_varlen() is not None and not self.batch_invariant
        self.num_q_heads = compat.num_q_heads_of_layers(vllm_config, layer_names)
        self.num_sms = num_sms()
        # Decodes first: query length 1, and under speculative decoding up to 1 + the drafted tokens.
        self._init_reorder_batch_threshold(decode_query_len(vllm_config))
        # vLLM captures whole batches of this query length (1 + speculative tokens): such a batch must not take the
        # dense path, whose context offsets and sizes come from the host and would replay stale from a graph.
        spec = getattr(vllm_config, "speculative_config", None) if vllm_config is not None else None
        self.capturable_query_len = 1 + (getattr(spec, "num_speculative_tokens", None) or 0)
        self.workspace_elems = reserve_workspace(vllm_config, self.num_q_heads, self.layout)

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        return cls._cudagraph_support

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TurboQuantMetadata:
        cam = common_attn_metadata
        num_reqs = cam.num_reqs
        qsl, seq_lens, block_table = cam.query_start_loc, cam.seq_lens, cam.block_table_tensor
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(
            cam, decode_threshold=self.reorder_batch_threshold)
        # vLLM counts the CUDA-graph padding past query_start_loc[num_reqs] as tokens of the last part; nothing
        # attends them and their outputs are discarded, so no launch covers them.
        padding = cam.num_actual_tokens - int(cam.query_start_loc_cpu[num_reqs])
        if num_prefills:
            num_prefill_tokens -= padding
        else:
            num_decode_tokens -= padding

        splits = 1 if self.batch_invariant else decode_num_splits(num_decodes, self.layout, self.num_sms)
        # Two kernel binaries, not one per length: a verification batch takes the threshold's slots, the shorter
        # queries in it leave theirs empty (a graph captured at the threshold replays any such batch).
        query_len = 1 if num_decode_tokens <= num_decodes else self.reorder_batch_threshold
        decode_qsl = decode_seq_lens = decode_bt = None
        if num_decodes:
            whole = num_prefills == 0  # persistent buffers as they are: safe to capture
            decode_qsl = qsl if whole else qsl[: num_decodes + 1]
            decode_seq_lens = seq_lens if whole else seq_lens[:num_decodes]
            decode_bt = block_table if whole else block_table[:num_decodes]
        prefill_qsl = prefill_seq_lens = prefill_bt = None
        if num_prefills:
            if num_decodes == 0:
                prefill_qsl, prefill_seq_lens, prefill_bt = qsl, seq_lens, block_table
            else:  # mixed batches never run inside a full CUDA graph: a fresh tensor is fine
                prefill_qsl = qsl[num_decodes : num_reqs + 1] - num_decode_tokens
                prefill_seq_lens = seq_lens[num_decodes:num_reqs]
                prefill_bt = block_table[num_decodes:num_reqs]

        dense = {}
        if (num_prefills and self.dense_prefill and num_prefill_tokens >= DENSE_PREFILL_MIN_TOKENS
                and cam.max_query_len > self.capturable_query_len):
            # Precise on prefill rows; a batch with a longer query than vLLM captures is never captured.
            lens_cpu = cam.seq_lens_cpu_upper_bound
            lens_cpu = (lens_cpu if lens_cpu is not None else seq_lens.cpu())[num_decodes:num_reqs]
            cu = torch.zeros(num_prefills + 1, dtype=torch.int32)
            torch.cumsum(lens_cpu, 0, out=cu[1:])
            dense = dict(prefill_cu_seqlens_k=cu.to(seq_lens.device, non_blocking=True),
                         prefill_total_k=int(cu[-1]), prefill_max_seq_len=int(lens_cpu.max()))

        workspace = None
        manager = compat.workspace_manager()
        if manager is not None:
            need = workspace_elems(num_decode_tokens, num_prefill_tokens, splits, self.num_q_heads,
                                   self.layout.head_dim)
            (workspace,) = manager.get_simultaneous(((max(need, 1),), torch.float32))

        return TurboQuantMetadata(
            num_actual_tokens=cam.num_actual_tokens,
            max_query_len=cam.max_query_len,
            max_seq_len=cam.max_seq_len,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=cam.slot_mapping,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            decode_num_splits=splits,
            decode_query_len=query_len,
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            prefill_max_query_len=cam.max_query_len,
            prefill_query_start_loc=prefill_qsl,
            prefill_seq_lens=prefill_seq_lens,
            prefill_block_table=prefill_bt,
            decode_query_start_loc=decode_qsl,
            decode_seq_lens=decode_seq_lens,
            decode_block_table=decode_bt,
            batch_invariant=self.batch_invariant,
            workspace=workspace,
            **dense,
        )


