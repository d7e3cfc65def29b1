"""The attention impl: store the step's keys/values, then attend over the compressed pages.

- Store: forward quantizes the new keys/values into their slots (ops.store_kv); in a batch of decodes the same
  launch rotates their queries into the cache's basis (vLLM calls no separate do_kv_cache_update).
- Attention: decodes run the decode kernel, the rest the general kernel or, for long prefills, FlashAttention over
  the context expanded into the model's basis (dense_prefill_attention); all read the same pages.
- Settings: each impl carries the engine's TurboQuantSettings (settings.engine_settings, resolved once per engine
  from --additional-config and the environment).
- Per-layer presets: the impl starts with the settings' preset; once the model is built (weights loaded) each layer
  gets its own (kv_spec.bind_layer_presets): a TurboQuant preset (bind_preset), or bf16, whose layer vLLM's
  FlashAttention then serves (served_by).
- Warm-up: once the weights are loaded, the kernels of this layer's shapes and preset are compiled (ops.warmup), so
  that no request waits for a Triton compile.
- Key calibration (optional, core.calibration): each layer takes its mean and scale from the file once its
  weights are loaded, sliced to its tensor-parallel rank's KV heads.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ..core.calibration import KeyCalibration, KeyStatistics
from ..core.layout import CacheLayout, cache_layout, layout_of_cache
from ..core.presets import Preset
from ..ops import RotatedQuery, dequantize_pages, paged_attention, store_kv, warm_up
from ..ops.constants import kernel_constants
from ..ops.utils import check_cache
from . import compat
from .compat import AttentionImpl, AttentionType
from .kv_spec import KERNEL_BLOCK_MULTIPLE, bind_layer_presets
from .metadata import TurboQuantMetadata, decode_query_len, reserve_workspace
from .settings import (
    CALIBRATION_CONFIG_KEY,
    CALIBRATION_ENV,
    COLLECT_ENV,
    describe_preset,
    engine_settings,
    first_time,
    key_statistics,
    layer_calibration,
    logger,
    num_model_layers,
    read_calibration,
)

WAY_OUT = "serve this model with another --attention-backend"


def pages_of(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's view of a layer's cache, (blocks, kv_heads, block_size, bytes a token), as the kernels' pages
    (blocks, kv_heads, head_page_bytes). A view, never a copy (a copy would take the stores): the backend's
    supported_kv_cache_layouts keep each (block, head) page contiguous, blocks at any stride."""
    if kv_cache.dim() != 4:
        return kv_cache
    blocks, heads, tokens, width = kv_cache.shape
    return kv_cache.view(blocks, heads, tokens * width)


def store_rotated_queries(num_decode_tokens: int, num_prefill_tokens: int, *, dense_prefill: bool,
                          batch_invariant: bool) -> int:
    """How many of a step's queries (decodes first) its store launch rotates into the cache's basis: the decodes',
    and the prefills' unless they take the dense path (bf16 FlashAttention over expanded pages takes them unrotated);
    none in batch-invariant mode (rotate_queries' arithmetic, whatever the step)."""
    if batch_invariant:
        return 0
    return num_decode_tokens + (0 if dense_prefill else num_prefill_tokens)


def dense_prefill_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, layout: CacheLayout, block_table: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_k: torch.Tensor, *, total_k: int,
    max_query_len: int, max_seq_len: int, scale: float, sliding_window: int | None, softcap: float | None,
    out: torch.Tensor, key_calibration: KeyCalibration | None = None, validate: bool = True,
) -> None:
    """Attention over the compressed pages for long prefills: expand the sequences' context once into the
    model's basis (exact cache values), then FlashAttention on the queries as they are, straight into `out`;
    the same result as paged_attention."""
    flash, version = compat.flash_attn_varlen()
    k, v = dequantize_pages(kv_cache, layout, block_table, seq_lens, cu_seqlens_k, total_k, max_seq_len, query.dtype,
                            key_calibration, validate=validate)
    window = [sliding_window - 1, 0] if sliding_window else [-1, -1]
    flash(query, k, v, max_seqlen_q=max_query_len, cu_seqlens_q=query_start_loc, max_seqlen_k=max_seq_len,
          cu_seqlens_k=cu_seqlens_k, softmax_scale=scale, causal=True, window_size=window, softcap=softcap or 0.0,
          out=out, fa_version=version)


class TurboQuantAttentionImpl(AttentionImpl[TurboQuantMetadata]):
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
            raise ValueError(f"TurboQuant serves decoder self-attention only, not {attn_type}; {WAY_OUT}")
        if alibi_slopes is not None:
            raise ValueError(f"TurboQuant does not support ALiBi; {WAY_OUT}")
        if extra.get("sinks") is not None:
            raise ValueError(f"TurboQuant does not support attention sinks; {WAY_OUT}")
        off = {"chunk_lookback": -1}  # options some models pass with their "disabled" value
        unknown = sorted(
            k for k, v in extra.items() if v is not None and v is not False and off.get(k, object()) != v
        )
        if unknown:  # a model asking for attention features we would silently ignore
            raise ValueError(f"TurboQuant does not support the attention option(s) {unknown}; {WAY_OUT}")
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
        self.settings = engine_settings(vllm_config)
        self.preset = self.settings.preset  # until bind_preset gives the layer its own
        layer_presets = self.settings.layer_presets
        cache_config = getattr(vllm_config, "cache_config", None)
        block_size = getattr(cache_config, "block_size", None) or KERNEL_BLOCK_MULTIPLE
        # Names the constraint if the head size or block size cannot be served.
        self.layout = cache_layout(self.preset, head_size, self.num_kv_heads, block_size)
        if layer_presets is not None:  # fails now, before the weights load; the per-layer line comes once bound
            layer_presets.check(head_size, num_model_layers(vllm_config))
        elif first_time("preset", self.preset.name, head_size):
            logger.info("%s", describe_preset(self.preset, head_size))
        # Reserved here, during model construction, so vLLM's memory profile counts the scratch
        # before it sizes the KV cache, for any preset this layer may get; every later layer finds it big enough.
        for preset in self.settings.turboquant_presets():
            reserve_workspace(vllm_config, num_heads, cache_layout(preset, head_size, self.num_kv_heads, block_size))
        self.vllm_config = vllm_config
        self.collect_statistics = os.environ.get(COLLECT_ENV) == "1"
        self.calibration_path = self.settings.calibration_path
        if self.calibration_path:
            if self.softcap:
                raise ValueError(
                    f"a key calibration is exact only without a logit soft-cap, and this model caps logits at "
                    f"{self.softcap}; unset {CALIBRATION_ENV} (and --additional-config {CALIBRATION_CONFIG_KEY})"
                )
            read_calibration(self.calibration_path)  # a missing or foreign file fails now, at startup
        self.layer_name: str | None = None
        self.key_calibration: KeyCalibration | None = None  # set once the layer is known (weights loaded)
        self._bound: tuple[torch.Size, CacheLayout] | None = None  # (shape, layout) of the cache last bound
        self.served_by: AttentionImpl | None = None  # vLLM's FlashAttention impl, once the layer is bf16

    def bind_preset(self, preset: Preset) -> None:
        """This layer's own preset (kv_spec.bind_layer_presets): its pages, kernels and warm-up."""
        self.preset = preset
        self.layout = cache_layout(preset, self.head_size, self.num_kv_heads, self.layout.block_size)

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        bind_layer_presets(self.vllm_config)  # every layer is built now: each gets its preset
        if self.served_by is not None:  # a bf16 layer: vLLM's FlashAttention serves it, nothing of ours runs
            self.served_by.process_weights_after_loading(act_dtype)
            return
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        if self.calibration_path or self.collect_statistics:
            # Every layer is registered by now, so the forward context names this one.
            self.layer_name = compat.layer_name_of(self, self.vllm_config)
        if self.calibration_path:
            rank, tp_size = compat.tensor_parallel_rank()
            self.key_calibration = layer_calibration(
                self.calibration_path, self.layer_name, self.num_kv_heads, self.head_size, rank, tp_size).to(device)
            if first_time("calibration", self.calibration_path):
                logger.info("TurboQuant key calibration: %s", self.calibration_path)
        # Build the kernels' device tables (rotation, codebooks) now, never inside a graph capture.
        if device.type == "cuda":
            kernel_constants(self.layout, device)
            self._warm_up(act_dtype, device)

    def _warm_up(self, dtype: torch.dtype, device: torch.device) -> None:
        """Compile the kernels now, once per layer shape, instead of inside the first requests (ops.warmup)."""
        layout = self.layout
        if not first_time("warm-up", layout, dtype, self.num_heads, self.sliding_window, self.softcap,
                          self.key_calibration is not None):
            return
        start = time.perf_counter()
        # Every decode batch size: graph capture compiles those of the captured sizes only. Batch-invariant mode runs
        # every row through the prefill-side kernels (no decode kernel, no dense path, metadata.py).
        max_seqs = getattr(getattr(self.vllm_config, "scheduler_config", None), "max_num_seqs", None) or 1
        invariant = compat.batch_invariant()
        warm_up(layout, dtype, self.num_heads, device, sliding_window=self.sliding_window, softcap=self.softcap,
                key_calibration=self.key_calibration,
                dense_prefill=compat.flash_attn_varlen() is not None and not invariant,
                decode_batches=() if invariant else range(1, max_seqs + 1),
                decode_query_len=decode_query_len(self.vllm_config))
        torch.cuda.synchronize(device)
        logger.info("TurboQuant kernels ready in %.1f s (compiled now rather than inside the first requests)",
                    time.perf_counter() - start)

    def _statistics(self) -> KeyStatistics:
        return key_statistics.setdefault(self.layer_name, KeyStatistics(self.num_kv_heads, self.head_size))

    def _cache_layout(self, kv_cache: torch.Tensor) -> CacheLayout:
        """The layout of the bound pages, derived and checked once per cache shape (vLLM binds one per layer)."""
        if self._bound is None or self._bound[0] != kv_cache.shape:
            layout = layout_of_cache(self.preset, self.head_size, tuple(kv_cache.shape))
            check_cache(kv_cache, layout)
            self._bound = (kv_cache.shape, layout)
        return self._bound[1]

    def _store(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
               kv_cache: torch.Tensor, layout: CacheLayout, md: TurboQuantMetadata) -> RotatedQuery | None:
        """Quantize the step's keys/values into their slots; the same launch rotates the queries paged_attention
        takes (store_rotated_queries) and returns them (None without any): no rotate_queries launch of its own, as
        eager steps are bound by issuing launches (benchmarks/layer_step)."""
        if key is None or value is None or self.kv_sharing_target_layer_name is not None:
            return None  # the layer reads another layer's cache
        # key/value may be padded past the real tokens; slot_mapping is not.
        n = min(md.slot_mapping.shape[0], key.shape[0])
        if self.collect_statistics:
            self._statistics().add_keys(key[:n][md.slot_mapping[:n] >= 0])
        rotate = store_rotated_queries(md.num_decode_tokens, md.num_prefill_tokens,
                                       dense_prefill=md.prefill_cu_seqlens_k is not None,
                                       batch_invariant=md.batch_invariant)
        return store_kv(key[:n], value[:n], kv_cache, md.slot_mapping, layout, self.key_calibration,
                        query=query[:rotate] if rotate else None, query_scale=self.scale, validate=False)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TurboQuantMetadata,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert output is not None, "TurboQuant writes into the output buffer vLLM provides"
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by TurboQuant")
        if attn_metadata is None:  # memory-profiling run: no cache, no metadata
            return output.fill_(0)
        md = attn_metadata
        kv_cache = pages_of(kv_cache)
        layout = self._cache_layout(kv_cache)  # every launch below skips re-checking the cache
        rotated = self._store(query, key, value, kv_cache, layout, md)
        if self.collect_statistics:
            self._statistics().add_queries(query[: md.num_actual_tokens])
        common = dict(scale=self.scale, sliding_window=self.sliding_window, softcap=self.softcap,
                      workspace=md.workspace, key_calibration=self.key_calibration, validate=False)
        if md.num_decodes:
            nd = md.num_decode_tokens
            paged_attention(
                query[:nd], kv_cache, layout, md.decode_block_table, md.decode_query_start_loc, md.decode_seq_lens,
                max_query_len=md.decode_query_len, out=output[:nd], num_splits=md.decode_num_splits,
                rotated_query=rotated and rotated.tokens(0, nd), batch_invariant=md.batch_invariant, decode=True,
                **common,
            )
        if md.num_prefills:
            lo, hi = md.num_decode_tokens, md.num_decode_tokens + md.num_prefill_tokens
            if md.prefill_cu_seqlens_k is not None:
                dense_prefill_attention(
                    query[lo:hi], kv_cache, layout, md.prefill_block_table, md.prefill_query_start_loc,
                    md.prefill_seq_lens, md.prefill_cu_seqlens_k, total_k=md.prefill_total_k,
                    max_query_len=md.prefill_max_query_len, max_seq_len=md.prefill_max_seq_len, scale=self.scale,
                    sliding_window=self.sliding_window, softcap=self.softcap, out=output[lo:hi],
                    key_calibration=self.key_calibration, validate=False)
            else:
                paged_attention(
                    query[lo:hi], kv_cache, layout, md.prefill_block_table, md.prefill_query_start_loc,
                    md.prefill_seq_lens, max_query_len=md.prefill_max_query_len, out=output[lo:hi], num_splits=1,
                    rotated_query=rotated and rotated.tokens(lo, hi), **common,
                )
        return output
