"""The TurboQuant KV-cache plugin for vLLM: serve from a TurboQuant-compressed paged KV cache.

    vllm serve MODEL --attention-backend CUSTOM --additional-config '{"turboquant_preset": "tq3"}'
    TURBOQUANT_PRESET=tq3 vllm serve MODEL --attention-backend CUSTOM      # the same, through the environment

``register()`` (called by turboquant_vllm.plugins, vLLM's ``vllm.general_plugins`` entry point) runs in every
process vLLM starts: the API server, the engine core and each worker. It only records where the backend class lives
and checks the settings the environment gives; it imports neither the backend nor any CUDA state. vLLM imports the
backend itself, once ``--attention-backend CUSTOM`` selects it (``TurboQuantAttentionBackend`` below resolves lazily,
behind the version gate; ``TQ4AttentionBackend`` is its older name, kept for deployments that name it).

Importing this package is cheap (no torch, no vLLM): the names below resolve on first use. Modules: requirements
(the vLLM releases and GPUs supported, the version gate), settings (TurboQuantSettings: the preset, per-layer presets
and key calibration from --additional-config and the environment, resolved once per engine), compat (vLLM's API
surface, behind the gate), kv_spec (compressed KV-cache specs), backend, metadata (builder), impl, calibrate.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import TurboQuantAttentionBackend
    from .backend import TurboQuantAttentionBackend as TQ4AttentionBackend  # noqa: F401
    from .settings import TurboQuantSettings

__all__ = [
    "BACKEND_PATH", "CALIBRATION_CONFIG_KEY", "CALIBRATION_ENV", "PRESET_CONFIG_KEY", "PRESET_ENV",
    "TQ4AttentionBackend", "TurboQuantAttentionBackend", "TurboQuantSettings", "register", "resolve_settings",
]

# The path vLLM resolves for AttentionBackendEnum.CUSTOM. It names this package, not the
# backend module, so that the version gate runs before any version-specific import.
BACKEND_PATH = "turboquant_vllm.vllm.TurboQuantAttentionBackend"
BACKEND_NAMES = ("TurboQuantAttentionBackend", "TQ4AttentionBackend")  # the class, and its older name

_registered = False


def register() -> None:
    """Make ``--attention-backend CUSTOM`` ours.

    Idempotent, cheap and CUDA-free: it runs in every vLLM process, whether or not the backend
    is selected. A bad setting in the environment (e.g. an unknown ``TURBOQUANT_PRESET``) fails
    here, at startup, through the resolver each engine runs on its --additional-config and the
    environment; a vLLM outside the tested range only warns here (other backends keep working)
    and fails with the range named as soon as the CUSTOM backend is resolved.
    """
    global _registered
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from .settings import logger, resolve_settings

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    if _registered:
        return
    settings = resolve_settings(None)  # raises ValueError naming the setting and the way out
    _registered = True
    # The version gate alone: compat's imports of vLLM's attention internals (~0.35 s, ~200 modules in a process that
    # never attends, e.g. the API server) wait until the backend resolves.
    from .requirements import UnsupportedVLLMVersion, check_vllm_version

    try:
        version = check_vllm_version()
        logger.debug("turboquant-vllm registered as the CUSTOM attention backend (vLLM %s; environment: %s)",
                     version, settings.describe())
    except UnsupportedVLLMVersion as exc:
        logger.warning("turboquant-vllm: %s", exc)


_SETTINGS = {"CALIBRATION_CONFIG_KEY", "CALIBRATION_ENV", "PRESET_CONFIG_KEY", "PRESET_ENV", "TurboQuantSettings",
             "resolve_settings"}


def __getattr__(name: str) -> Any:
    if name in _SETTINGS:
        return getattr(importlib.import_module(".settings", __name__), name)
    if name in BACKEND_NAMES:
        from . import compat

        compat.check_vllm_version()  # clear refusal, naming the tested range
        from .backend import TurboQuantAttentionBackend

        return TurboQuantAttentionBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
