"""The CUSTOM attention backend: paged attention straight over a TurboQuant-compressed KV cache.

One file, vLLM-style: backend class, metadata, metadata builder, impl.

- Cache: per layer a uint8 tensor (num_blocks, num_kv_heads, head_page_bytes) laid out by
  ``core.layout.CacheLayout``; its page size reaches vLLM's allocator through the layer's KV-cache
  spec (see ``compat``), so vLLM's "GPU KV cache size" counts compressed tokens.
- Store: ``do_kv_cache_update`` quantizes the new keys/values into their slots (``store_kv``).
- Attention: one batch = decodes first (query length 1), then everything else (prefills,
  chunked-prefill continuations, speculative-decode verifications). Decodes run the split-KV
  decode kernel, the rest the tiled kernel; both are ``paged_attention`` over the same pages.
- CUDA graphs: ``UNIFORM_BATCH``. A captured uniform batch only references persistent buffers
  (query_start_loc, seq_lens, block table, the shared workspace) and fixes its split count from
  the batch shape, so replays see new data at the same addresses.
- Scratch: one fp32 buffer from vLLM's workspace manager, shared by every layer, reserved at its
  maximum when the first layer is built (before memory profiling and CUDA-graph capture).
- Key calibration (optional, core.calibration): each layer takes its mean and scale from the file
  once its weights are loaded, sliced to its tensor-parallel rank's KV heads.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..core.calibration import KeyCalibration, KeyStatistics, load_calibration
from ..core.layout import MAX_HEAD_DIM, MIN_HEAD_DIM, CacheLayout
from ..core.presets import DEFAULT_PRESET, Preset, get_preset
from . import CALIBRATION_ENV, COLLECT_ENV, compat, logger, resolve_calibration_path, resolve_preset
from .compat import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

KERNEL_BLOCK_MULTIPLE = 16  # vLLM block sizes we accept: multiples of 16 (CacheLayout needs 4)
MIN_COMPUTE_CAPABILITY = 80  # bf16 tl.dot
NUM_SMS_FALLBACK = 132  # H200, where no device can be asked (CPU tests)

# ---------------------------------------------------------------------------------------------
# Process-wide preset: resolved once from the vLLM config / environment, then fixed, so that the
# spec (engine side) and get_kv_cache_shape (worker side, which gets no config) agree.
# ---------------------------------------------------------------------------------------------
_process_preset: Preset | None = None
_logged: set[tuple] = set()  # what was logged or warmed up once per process


# From this many prefill tokens in a step, expanding the context once and running FlashAttention
# beats re-decoding the compressed context for every tile of query tokens.
DENSE_PREFILL_MIN_TOKENS = 256


def dense_prefill_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, layout: CacheLayout, block_table: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_k: torch.Tensor, *, total_k: int,
    max_query_len: int, max_seq_len: int, scale: float, sliding_window: int | None, softcap: float | None,
    out: torch.Tensor, key_calibration: KeyCalibration | None = None,
) -> None:
    """Attention over the compressed pages for long prefills: expand the sequences' context once into the
    model's basis (exact cache values), then FlashAttention on the queries as they are, straight into `out`;
    the same result as paged_attention."""
    from ..kernels import dequantize_pages

    flash, version = compat.flash_attn_varlen()
    k, v = dequantize_pages(kv_cache, layout, block_table, seq_lens, cu_seqlens_k, total_k, max_seq_len, query.dtype,
                            key_calibration)
    window = [sliding_window - 1, 0] if sliding_window else [-1, -1]
    flash(query, k, v, max_seqlen_q=max_query_len, cu_seqlens_q=query_start_loc, max_seqlen_k=max_seq_len,
          cu_seqlens_k=cu_seqlens_k, softmax_scale=scale, causal=True, window_size=window, softcap=softcap or 0.0,
          out=out, fa_version=version)


def process_preset(vllm_config: Any | None = None) -> Preset:
    global _process_preset
    if vllm_config is None:
        if _process_preset is not None:
            return _process_preset
        vllm_config = compat.current_vllm_config()
    preset = resolve_preset(vllm_config)
    if _process_preset is None:
        _process_preset = preset
    elif preset != _process_preset:
        raise ValueError(
            f"TurboQuant preset changed within one process ({_process_preset.name} -> {preset.name}); "
            "set it once, through TURBOQUANT_PRESET or --additional-config"
        )
    return preset


def describe_preset(preset: Preset, head_dim: int) -> str:
    """The one startup line: preset, bytes per token per KV head and the gain over bf16."""
    tq = preset.bytes_per_token_per_head(head_dim)
    bf16 = 2 * 2 * head_dim
    return (
        f"TurboQuant KV cache: preset {preset.name} ({preset.k_bits}-bit K, {preset.v_bits}-bit V), "
        f"head_dim {head_dim}: {tq} B per token per KV head vs {bf16} B in bf16 -> "
        f"{bf16 / tq:.2f}x KV-cache capacity"
    )


def _log_preset_once(preset: Preset, head_dim: int) -> None:
    key = (preset.name, head_dim)
    if key not in _logged:
        _logged.add(key)
        logger.info("%s", describe_preset(preset, head_dim))


@functools.lru_cache(maxsize=None)
def _layout(preset: Preset, head_dim: int, num_kv_heads: int, block_size: int) -> CacheLayout:
    return CacheLayout(preset, head_dim, num_kv_heads, block_size)


def layout_of_cache(preset: Preset, head_dim: int, kv_cache: torch.Tensor) -> CacheLayout:
    """The layout a bound cache tensor (num_blocks, num_kv_heads, head_page_bytes) was made with."""
    per_token = preset.bytes_per_token_per_head(head_dim)
    head_page_bytes = kv_cache.shape[-1]
    if kv_cache.dim() != 3 or head_page_bytes % per_token:
        raise ValueError(
            f"KV cache of shape {tuple(kv_cache.shape)} was not laid out for preset {preset.name} at "
            f"head_dim {head_dim} ({per_token} B per token per head)"
        )
    return _layout(preset, head_dim, kv_cache.shape[1], head_page_bytes // per_token)


# ---------------------------------------------------------------------------------------------
# Key calibration: read once per process, sliced per layer and rank; statistics for calibrate.
# ---------------------------------------------------------------------------------------------
_read_calibration = functools.lru_cache(maxsize=None)(load_calibration)
key_statistics: dict[str, KeyStatistics] = {}  # layer name -> sums, while COLLECT_ENV is set


def rank_kv_heads(total: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(first, count) of the KV heads a tensor-parallel rank holds; vLLM replicates them when total < tp_size."""
    if total >= tp_size:
        return rank * (total // tp_size), total // tp_size
    return rank * total // tp_size, 1


def layer_calibration(path: str, layer_name: str, num_kv_heads: int, head_dim: int) -> KeyCalibration:
    """This rank's part of layer_name's key calibration in the file at path."""
    layers = _read_calibration(path)
    if layer_name not in layers:
        raise ValueError(
            f"key calibration {path} has no layer {layer_name!r} (it has {len(layers)}, e.g. {next(iter(layers))!r}); "
            f"it was made for another model: run `turboquant-vllm calibrate` for this one, or unset {CALIBRATION_ENV}"
        )
    cal = layers[layer_name]
    rank, tp_size = compat.tensor_parallel_rank()
    first, count = rank_kv_heads(cal.num_kv_heads, tp_size, rank)
    if cal.head_dim != head_dim or count != num_kv_heads:
        raise ValueError(
            f"key calibration {path} has {cal.num_kv_heads} KV heads of dim {cal.head_dim} for {layer_name}, but this "
            f"rank serves {num_kv_heads} of dim {head_dim} (tensor parallel size {tp_size}); it was made for another "
            "model: run `turboquant-vllm calibrate` for this one"
        )
    return cal.heads(first, count)


# ---------------------------------------------------------------------------------------------
# Split-KV scratch: one buffer for all layers, reserved at its maximum.
# ---------------------------------------------------------------------------------------------
def num_sms() -> int:
    return compat.num_compute_units() or NUM_SMS_FALLBACK


def decode_num_splits(num_decodes: int, num_kv_heads: int, sms: int, preset: Preset, head_dim: int) -> int:
    from ..kernels.attention import decode_launch, default_num_splits

    if not num_decodes:
        return 1
    return default_num_splits(num_decodes, num_kv_heads, sms, decode_launch(preset, head_dim).programs_per_sm)


def workspace_elems(
    num_decode_tokens: int, num_prefill_tokens: int, splits: int, num_q_heads: int, head_dim: int
) -> int:
    """fp32 elements one step needs; the decode and the prefill launch run in turn and share them."""
    from ..kernels import attention_workspace_shape

    decode = attention_workspace_shape(num_decode_tokens, num_q_heads, head_dim, splits)[0]
    prefill = attention_workspace_shape(num_prefill_tokens, num_q_heads, head_dim, 1)[0]
    return max(decode, prefill)


@functools.lru_cache(maxsize=None)
def max_workspace_elems(
    num_q_heads: int, num_kv_heads: int, head_dim: int, max_tokens: int, max_seqs: int, sms: int, preset: Preset
) -> int:
    """The most any step can need: a full prefill budget unsplit, or any decode batch split."""
    most = workspace_elems(0, max_tokens, 1, num_q_heads, head_dim)
    for seqs in range(1, min(max_seqs, max_tokens) + 1):
        splits = decode_num_splits(seqs, num_kv_heads, sms, preset, head_dim)
        most = max(most, workspace_elems(seqs, 0, splits, num_q_heads, head_dim))
    return most


def reserve_workspace(vllm_config: Any, num_q_heads: int, num_kv_heads: int, head_dim: int,
                      preset: Preset) -> int | None:
    """Grow vLLM's shared workspace to the maximum this backend can ask for; idempotent across layers."""
    manager = compat.workspace_manager()
    if manager is None or vllm_config is None:
        return None
    scheduler = vllm_config.scheduler_config
    max_tokens = max(
        scheduler.max_num_batched_tokens,
        getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", None) or 0,
    )
    elems = max_workspace_elems(num_q_heads, num_kv_heads, head_dim, max_tokens, scheduler.max_num_seqs, num_sms(),
                                preset)
    manager.get_simultaneous(((elems,), torch.float32))
    return elems


# ---------------------------------------------------------------------------------------------
# Backend
# ---------------------------------------------------------------------------------------------
_WAY_OUT = "serve this model with another --attention-backend"


def _explain(reason: str, cfg: dict[str, Any]) -> str:
    """vLLM's terse validation reason -> the constraint and the way out."""
    table = {
        "head_size not supported": (
            f"head size {cfg.get('head_size')} is not supported (TurboQuant needs a multiple of 16 in "
            f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]); {_WAY_OUT}"
        ),
        "dtype not supported": f"model dtype {cfg.get('dtype')} is not supported; run with --dtype bfloat16 or float16",
        "kv_cache_dtype not supported": (
            f"--kv-cache-dtype {cfg.get('kv_cache_dtype')} cannot be combined with TurboQuant, which sets the "
            "KV-cache format itself; drop --kv-cache-dtype and pick the preset with TURBOQUANT_PRESET"
        ),
        "block_size not supported": (
            f"--block-size {cfg.get('block_size')} is not supported; use a multiple of {KERNEL_BLOCK_MULTIPLE}"
        ),
        "MLA not supported": f"MLA (latent attention) models are not supported; {_WAY_OUT}",
        "attention sinks not supported": f"attention sinks are not supported; {_WAY_OUT}",
        "sparse not supported": f"sparse attention is not supported; {_WAY_OUT}",
        "per-head quant scales not supported": (
            f"checkpoints with per-head KV quantization scales are not supported; {_WAY_OUT}"
        ),
        "compute capability not supported": (
            f"needs an NVIDIA GPU of compute capability {MIN_COMPUTE_CAPABILITY // 10}.{MIN_COMPUTE_CAPABILITY % 10}"
            f" or newer; {_WAY_OUT}"
        ),
        "non-causal attention not supported": (
            f"non-causal (bidirectional) decoder attention is not supported; {_WAY_OUT}"
        ),
        "batch invariance not supported": "VLLM_BATCH_INVARIANT=1 is not supported; unset it",
        "KV connector not supported": (
            "KV connectors (--kv-transfer-config) are not supported: they move uncompressed pages; drop the option"
        ),
        "partial multimodal token full attention not supported": (
            f"bidirectional attention over multimodal prefixes is not supported; {_WAY_OUT}"
        ),
    }
    if reason in table:
        return table[reason]
    if reason.startswith("attention type"):
        return (
            f"{reason}: only decoder self-attention is (no encoder, encoder-only or cross attention); {_WAY_OUT}"
        )
    return reason


class TQ4AttentionBackend(AttentionBackend):
    """TurboQuant KV cache (preset from TURBOQUANT_PRESET / --additional-config, tq4 by default)."""

    turboquant_backend: ClassVar[bool] = True  # how compat's spec hook recognizes our layers
    # forward stores the step's keys/values itself: in a batch of decodes the same launch rotates their queries
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type["TQ4AttentionImpl"]:
        return TQ4AttentionImpl

    @staticmethod
    def get_builder_cls() -> type["TQ4MetadataBuilder"]:
        return TQ4MetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        # Multiples only: the kernel block is then always vLLM's block, never a split of it
        # (a split page would not be laid out as a page of the smaller size).
        return [MultipleOf(KERNEL_BLOCK_MULTIPLE)]

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        # cache_dtype_str is "auto" for our specs: the layout comes from the process's preset.
        if block_size % KERNEL_BLOCK_MULTIPLE:
            raise ValueError(f"TurboQuant block size must be a multiple of {KERNEL_BLOCK_MULTIPLE}, got {block_size}")
        return _layout(process_preset(), head_size, num_kv_heads, block_size).cache_shape(num_blocks)

    # get_kv_cache_stride_order stays unimplemented: the physical layout is the logical shape,
    # blocks first, and nothing is permuted.

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(range(MIN_HEAD_DIM, MAX_HEAD_DIM + 1, 16))

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        # The head-size constraint is the layout's and the same for every preset.
        try:
            CacheLayout(get_preset(DEFAULT_PRESET), head_size, 1, KERNEL_BLOCK_MULTIPLE)
        except ValueError:
            return False
        return True

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or (block_size > 0 and block_size % KERNEL_BLOCK_MULTIPLE == 0)

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        return capability is None or capability.to_int() >= MIN_COMPUTE_CAPABILITY

    @classmethod
    def validate_configuration(cls, **kwargs: Any) -> list[str]:
        """vLLM's checks (through the supports_* methods), reworded to name the way out, plus ours."""
        reasons = [_explain(r, kwargs) for r in super().validate_configuration(**kwargs)]
        vllm_config = compat.current_vllm_config()
        reasons += compat.config_problems(vllm_config)
        try:
            preset = process_preset(vllm_config)
            head_size = kwargs.get("head_size")
            if head_size is not None and cls.supports_head_size(head_size):
                CacheLayout(preset, head_size, 1, KERNEL_BLOCK_MULTIPLE)  # the preset's own head-size limits
        except ValueError as exc:
            reasons.append(str(exc))
        return reasons

    @staticmethod
    def use_cascade_attention(*args: Any, **kwargs: Any) -> bool:
        return False


# ---------------------------------------------------------------------------------------------
# Metadata and its builder
# ---------------------------------------------------------------------------------------------
@dataclass
class TQ4Metadata(AttentionMetadata):
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # (num_reqs + 1,) int32
    seq_lens: torch.Tensor  # (num_reqs,) int32
    block_table: torch.Tensor  # (num_reqs, max_blocks) int32
    slot_mapping: torch.Tensor

    # Decodes (query length 1) come first: requests [0, num_decodes), tokens [0, num_decode_tokens).
    num_decodes: int
    num_decode_tokens: int
    decode_num_splits: int
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

    workspace: torch.Tensor | None  # view of vLLM's shared workspace (fp32), None without one

    # Long prefills: the prefill part's context, expanded once and attended by FlashAttention.
    prefill_cu_seqlens_k: torch.Tensor | None = None  # (num_prefills + 1,) int32, None: paged kernel
    prefill_total_k: int = 0
    prefill_max_seq_len: int = 0


class TQ4MetadataBuilder(AttentionMetadataBuilder[TQ4Metadata]):
    # Uniform batches (all decodes, or all speculative verifications of one length) may be
    # captured whole; mixed batches run attention eagerly between piecewise graphs.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        compat.check_builder_spec(kv_cache_spec, layer_names)
        self.preset = process_preset(vllm_config)
        self.dense_prefill = compat.flash_attn_varlen() is not None
        self.head_dim = kv_cache_spec.head_size
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.num_q_heads = compat.num_q_heads_of_layers(vllm_config, layer_names)
        self.num_sms = num_sms()
        # Decodes first; speculative verifications (query length > 1) go to the general kernel.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)
        self.workspace_elems = reserve_workspace(vllm_config, self.num_q_heads, self.num_kv_heads, self.head_dim,
                                                 self.preset)

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        return cls._cudagraph_support

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TQ4Metadata:
        cam = common_attn_metadata
        num_reqs = cam.num_reqs
        qsl, seq_lens, block_table = cam.query_start_loc, cam.seq_lens, cam.block_table_tensor
        qsl_cpu = cam.query_start_loc_cpu[: num_reqs + 1]
        # Tokens past qsl[num_reqs] are padding (CUDA-graph sizes): never attended, outputs unused.
        num_tokens = int(qsl_cpu[num_reqs])
        if cam.max_query_len <= 1:
            num_decodes, num_decode_tokens = num_reqs, num_tokens
        else:
            is_long = (qsl_cpu[1:] - qsl_cpu[:-1]) > 1
            num_decodes = int(is_long.int().argmax())  # first request longer than one token
            num_decode_tokens = int(qsl_cpu[num_decodes])
        num_prefills = num_reqs - num_decodes
        num_prefill_tokens = num_tokens - num_decode_tokens

        splits = decode_num_splits(num_decodes, self.num_kv_heads, self.num_sms, self.preset, self.head_dim)
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
        if num_prefills and self.dense_prefill and num_prefill_tokens >= DENSE_PREFILL_MIN_TOKENS:
            # Precise on prefill rows; prefill batches are never captured, so reading it is fine.
            lens_cpu = cam.seq_lens_cpu_upper_bound
            lens_cpu = (lens_cpu if lens_cpu is not None else seq_lens.cpu())[num_decodes:num_reqs]
            cu = torch.zeros(num_prefills + 1, dtype=torch.int32)
            torch.cumsum(lens_cpu, 0, out=cu[1:])
            dense = dict(prefill_cu_seqlens_k=cu.to(seq_lens.device, non_blocking=True),
                         prefill_total_k=int(cu[-1]), prefill_max_seq_len=int(lens_cpu.max()))

        workspace = None
        manager = compat.workspace_manager()
        if manager is not None:
            need = workspace_elems(num_decode_tokens, num_prefill_tokens, splits, self.num_q_heads, self.head_dim)
            (workspace,) = manager.get_simultaneous(((max(need, 1),), torch.float32))

        return TQ4Metadata(
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
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            prefill_max_query_len=cam.max_query_len,
            prefill_query_start_loc=prefill_qsl,
            prefill_seq_lens=prefill_seq_lens,
            prefill_block_table=prefill_bt,
            decode_query_start_loc=decode_qsl,
            decode_seq_lens=decode_seq_lens,
            decode_block_table=decode_bt,
            workspace=workspace,
            **dense,
        )


# ---------------------------------------------------------------------------------------------
# Impl
# ---------------------------------------------------------------------------------------------
class TQ4AttentionImpl(AttentionImpl[TQ4Metadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra: Any,
    ) -> None:
        if attn_type != AttentionType.DECODER:
            raise ValueError(f"TurboQuant serves decoder self-attention only, not {attn_type}; {_WAY_OUT}")
        if alibi_slopes is not None:
            raise ValueError(f"TurboQuant does not support ALiBi; {_WAY_OUT}")
        if extra.get("sinks") is not None:
            raise ValueError(f"TurboQuant does not support attention sinks; {_WAY_OUT}")
        off = {"chunk_lookback": -1}  # options some models pass with their "disabled" value
        unknown = sorted(
            k for k, v in extra.items() if v is not None and v is not False and off.get(k, object()) != v
        )
        if unknown:  # a model asking for attention features we would silently ignore
            raise ValueError(f"TurboQuant does not support the attention option(s) {unknown}; {_WAY_OUT}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window  # tokens, the current one included (vLLM's meaning)
        self.softcap = float(logits_soft_cap) if logits_soft_cap else None
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

        vllm_config = compat.current_vllm_config()
        self.preset = process_preset(vllm_config)
        CacheLayout(self.preset, head_size, self.num_kv_heads, KERNEL_BLOCK_MULTIPLE)  # names the constraint
        _log_preset_once(self.preset, head_size)
        compat.install_kv_cache_spec_hook()
        # Reserved here, during model construction, so vLLM's memory profile counts the scratch
        # before it sizes the KV cache; every later layer finds it big enough.
        reserve_workspace(vllm_config, num_heads, self.num_kv_heads, head_size, self.preset)
        self.vllm_config = vllm_config
        self.collect_statistics = os.environ.get(COLLECT_ENV) == "1"
        self.calibration_path = resolve_calibration_path(vllm_config)
        if self.calibration_path:
            if self.softcap:
                raise ValueError(
                    f"a key calibration is exact only without a logit soft-cap, and this model caps logits at "
                    f"{self.softcap}; unset {CALIBRATION_ENV} (and --additional-config turboquant_key_calibration)"
                )
            _read_calibration(self.calibration_path)  # a missing or foreign file fails now, at startup
        self.layer_name: str | None = None
        self.key_calibration: KeyCalibration | None = None  # set once the layer is known (weights loaded)

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        if self.calibration_path or self.collect_statistics:
            # Every layer is registered by now, so the forward context names this one.
            self.layer_name = compat.layer_name_of(self, self.vllm_config)
        if self.calibration_path:
            self.key_calibration = layer_calibration(
                self.calibration_path, self.layer_name, self.num_kv_heads, self.head_size).to(device)
            if ("calibration", self.calibration_path) not in _logged:
                _logged.add(("calibration", self.calibration_path))
                logger.info("TurboQuant key calibration: %s", self.calibration_path)
        # Build the kernels' device tables (rotation, codebooks) now, never inside a graph capture.
        if device.type == "cuda":
            from ..kernels.constants import kernel_constants

            layout = _layout(self.preset, self.head_size, self.num_kv_heads, KERNEL_BLOCK_MULTIPLE)
            kernel_constants(layout, device)
            self._warm_up(act_dtype, device)

    def _warm_up(self, dtype: torch.dtype, device: torch.device) -> None:
        """Compile the kernels now, once per layer shape, instead of inside the first requests (kernels.warmup)."""
        from ..kernels import warm_up

        cache_config = getattr(self.vllm_config, "cache_config", None)
        block_size = getattr(cache_config, "block_size", None) or KERNEL_BLOCK_MULTIPLE
        layout = _layout(self.preset, self.head_size, self.num_kv_heads, block_size)
        key = ("warm-up", layout, dtype, self.num_heads, self.sliding_window, self.softcap,
               self.key_calibration is not None)
        if key in _logged:
            return
        _logged.add(key)
        start = time.perf_counter()
        # Every split count a decode batch can take: graph capture compiles those of the captured sizes only.
        max_seqs = getattr(getattr(self.vllm_config, "scheduler_config", None), "max_num_seqs", None) or 1
        splits = {decode_num_splits(b, self.num_kv_heads, num_sms(), self.preset, self.head_size)
                  for b in range(1, max_seqs + 1)}
        warm_up(layout, dtype, self.num_heads, device, sliding_window=self.sliding_window, softcap=self.softcap,
                key_calibration=self.key_calibration, dense_prefill=compat.flash_attn_varlen() is not None,
                decode_splits=splits)
        torch.cuda.synchronize(device)
        logger.info("TurboQuant kernels ready in %.1f s (compiled now rather than inside the first requests)",
                    time.perf_counter() - start)

    def _statistics(self) -> KeyStatistics:
        return key_statistics.setdefault(self.layer_name, KeyStatistics(self.num_kv_heads, self.head_size))

    def _store(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
               kv_cache: torch.Tensor, md: TQ4Metadata) -> torch.Tensor | None:
        """Quantize the step's keys/values into their slots. In a batch of decodes only, the same launch rotates
        their queries into the cache's basis: returns them for paged_attention (None otherwise)."""
        if key is None or value is None or self.kv_sharing_target_layer_name is not None:
            return None  # the layer reads another layer's cache
        from ..kernels import store_kv

        # key/value may be padded past the real tokens; slot_mapping is not.
        n = min(md.slot_mapping.shape[0], key.shape[0])
        if self.collect_statistics:
            self._statistics().add_keys(key[:n][md.slot_mapping[:n] >= 0])
        decodes_only = md.num_decodes and not md.num_prefills
        return store_kv(key[:n], value[:n], kv_cache, md.slot_mapping, layout_of_cache(self.preset, self.head_size,
                        kv_cache), self.key_calibration, query=query[: md.num_decode_tokens] if decodes_only else None,
                        query_scale=self.scale)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TQ4Metadata,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert output is not None, "TurboQuant writes into the output buffer vLLM provides"
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by TurboQuant")
        if attn_metadata is None:  # memory-profiling run: no cache, no metadata
            return output.fill_(0)
        from ..kernels import paged_attention

        md = attn_metadata
        rotated = self._store(query, key, value, kv_cache, md)
        layout = layout_of_cache(self.preset, self.head_size, kv_cache)
        if self.collect_statistics:
            self._statistics().add_queries(query[: md.num_actual_tokens])
        common = dict(scale=self.scale, sliding_window=self.sliding_window, softcap=self.softcap,
                      workspace=md.workspace, key_calibration=self.key_calibration)
        if md.num_decodes:
            nd = md.num_decode_tokens
            paged_attention(
                query[:nd], kv_cache, layout, md.decode_block_table, md.decode_query_start_loc, md.decode_seq_lens,
                max_query_len=1, out=output[:nd], num_splits=md.decode_num_splits, rotated_query=rotated, **common,
            )
        if md.num_prefills and md.prefill_cu_seqlens_k is not None:
            lo, hi = md.num_decode_tokens, md.num_decode_tokens + md.num_prefill_tokens
            dense_prefill_attention(
                query[lo:hi], kv_cache, layout, md.prefill_block_table, md.prefill_query_start_loc,
                md.prefill_seq_lens, md.prefill_cu_seqlens_k, total_k=md.prefill_total_k,
                max_query_len=md.prefill_max_query_len, max_seq_len=md.prefill_max_seq_len, scale=self.scale,
                sliding_window=self.sliding_window, softcap=self.softcap, out=output[lo:hi],
                key_calibration=self.key_calibration)
        elif md.num_prefills:
            lo, hi = md.num_decode_tokens, md.num_decode_tokens + md.num_prefill_tokens
            paged_attention(
                query[lo:hi], kv_cache, layout, md.prefill_block_table, md.prefill_query_start_loc,
                md.prefill_seq_lens, max_query_len=md.prefill_max_query_len, out=output[lo:hi], num_splits=1,
                **common,
            )
        return output
