"""The CUSTOM attention backend: paged attention straight over a TurboQuant-compressed KV cache.

The backend class names the pieces, vLLM-style: the KV-cache spec (customize_spec: uint8 pages of the preset's bytes
per token, laid out by core.layout.CacheLayout, see kv_spec) and the layouts of vLLM's cache views the kernels read,
the metadata builder (metadata.py) and the impl (impl.py); and it states what it supports, so that vLLM refuses
everything else at startup with a message naming the constraint and the way out.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch

from ..core.layout import MAX_HEAD_DIM, MIN_HEAD_DIM, cache_layout
from ..core.presets import DEFAULT_PRESET, get_preset
from . import compat
from .compat import AttentionBackend, MultipleOf
from .impl import WAY_OUT, TurboQuantAttentionImpl
from .kv_spec import KERNEL_BLOCK_MULTIPLE, config_problems, turboquant_spec
from .metadata import TurboQuantMetadataBuilder
from .requirements import MIN_COMPUTE_CAPABILITY
from .settings import engine_settings, num_model_layers


def _explain(reason: str, cfg: dict[str, Any]) -> str:
    """vLLM's terse validation reason -> the constraint and the way out."""
    table = {
        "head_size not supported": (
            f"head size {cfg.get('head_size')} is not supported (TurboQuant needs a multiple of 16 in "
            f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]); {WAY_OUT}"
        ),
        "dtype not supported": f"model dtype {cfg.get('dtype')} is not supported; run with --dtype bfloat16 or float16",
        "kv_cache_dtype not supported": (
            f"--kv-cache-dtype {cfg.get('kv_cache_dtype')} cannot be combined with TurboQuant, which sets the "
            "KV-cache format itself; drop --kv-cache-dtype and pick the preset with --additional-config "
            "turboquant_preset (or TURBOQUANT_PRESET)"
        ),
        "block_size not supported": (
            f"--block-size {cfg.get('block_size')} is not supported; use a multiple of {KERNEL_BLOCK_MULTIPLE}"
        ),
        "MLA not supported": f"MLA (latent attention) models are not supported; {WAY_OUT}",
        "attention sinks not supported": f"attention sinks are not supported; {WAY_OUT}",
        "sparse not supported": f"sparse attention is not supported; {WAY_OUT}",
        "per-head quant scales not supported": (
            f"checkpoints with per-head KV quantization scales are not supported; {WAY_OUT}"
        ),
        "compute capability not supported": (
            f"needs an NVIDIA GPU of compute capability {MIN_COMPUTE_CAPABILITY // 10}.{MIN_COMPUTE_CAPABILITY % 10}"
            f" or newer; {WAY_OUT}"
        ),
        "non-causal attention not supported": (
            f"non-causal (bidirectional) decoder attention is not supported; {WAY_OUT}"
        ),
        "KV connector not supported": (
            "KV connectors (--kv-transfer-config) are not supported: they move uncompressed pages; drop the option"
        ),
        "partial multimodal token full attention not supported": (
            f"bidirectional attention over multimodal prefixes is not supported; {WAY_OUT}"
        ),
    }
    if reason in table:
        return table[reason]
    if reason.startswith("attention type"):
        return (
            f"{reason}: only decoder self-attention is (no encoder, encoder-only or cross attention); {WAY_OUT}"
        )
    return reason


class TurboQuantAttentionBackend(AttentionBackend):
    """TurboQuant KV cache, of any preset (settings.TurboQuantSettings: --additional-config or the environment).

    vLLM's selector gives every layer this class; once the model is built, kv_spec.bind_layer_presets gives each
    layer the subclass for its own preset (for_preset), whose customize_spec gives the layer that preset's pages (the
    runners take each layer's spec from its layer's backend after the model is built).
    """

    turboquant_backend: ClassVar[bool] = True  # how kv_spec recognizes our layers
    preset_name: ClassVar[str | None] = None  # the preset of the layers a for_preset subclass serves
    # forward stores the step's keys/values itself: in a batch of decodes the same launch rotates their queries
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[TurboQuantAttentionImpl]:
        return TurboQuantAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TurboQuantMetadataBuilder]:
        return TurboQuantMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        # Multiples only: the kernel block is then always vLLM's block, never a split of it
        # (a split page would not be laid out as a page of the smaller size).
        return [MultipleOf(KERNEL_BLOCK_MULTIPLE)]

    @staticmethod
    def for_preset(name: str) -> type[TurboQuantAttentionBackend]:
        """This backend for the layers of one preset: the runners take a layer's spec and builder from its backend."""
        return _preset_backend(name)

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        """The layer's spec over compressed pages of this class's preset (kv_spec.turboquant_spec); on the unbound
        class, of the engine's preset (vLLM may ask before the model is built, e.g. to align page sizes)."""
        if cls.preset_name:
            return turboquant_spec(spec, get_preset(cls.preset_name))
        return turboquant_spec(spec, engine_settings(compat.current_vllm_config()).preset)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[Any, ...]:
        # The kernels read one (block, KV head) page as contiguous bytes: H, N, C innermost, blocks at any stride.
        return compat.BLOCK_CONTIGUOUS_LAYOUTS

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(range(MIN_HEAD_DIM, MAX_HEAD_DIM + 1, 16))

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        # The head-size constraint is the layout's and the same for every preset.
        try:
            cache_layout(get_preset(DEFAULT_PRESET), head_size, 1, KERNEL_BLOCK_MULTIPLE)
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
    def supports_batch_invariance(cls) -> bool:
        """VLLM_BATCH_INVARIANT=1: every row at one split through one kernel (metadata.py), at a decode-speed cost."""
        return True

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        return capability is None or capability.to_int() >= MIN_COMPUTE_CAPABILITY

    @classmethod
    def validate_configuration(cls, **kwargs: Any) -> list[str]:
        """vLLM's checks (through the supports_* methods), reworded to name the way out, plus ours."""
        reasons = [_explain(r, kwargs) for r in super().validate_configuration(**kwargs)]
        vllm_config = compat.current_vllm_config()
        reasons += config_problems(vllm_config)
        try:
            settings = engine_settings(vllm_config)
            head_size = kwargs.get("head_size")
            if head_size is not None and cls.supports_head_size(head_size):
                cache_layout(settings.preset, head_size, 1, KERNEL_BLOCK_MULTIPLE)  # the preset's own head-size limits
                if settings.layer_presets is not None:
                    settings.layer_presets.check(head_size, num_model_layers(vllm_config))
        except ValueError as exc:
            reasons.append(str(exc))
        return reasons

    @staticmethod
    def use_cascade_attention(*args: Any, **kwargs: Any) -> bool:
        return False


@functools.cache
def _preset_backend(name: str) -> type[TurboQuantAttentionBackend]:
    # One class per preset: the runners group layers by backend class name and spec.
    cls_name = f"TurboQuantAttentionBackend_{name}"
    return type(cls_name, (TurboQuantAttentionBackend,), {"preset_name": name, "__module__": __name__,
                                                    "__qualname__": cls_name})
