"""The TurboQuant KV-cache plugin for vLLM: serve from a TurboQuant-compressed paged KV cache.

    TURBOQUANT_PRESET=tq4 vllm serve MODEL --attention-backend CUSTOM

``register()`` (called by turboquant_vllm.plugins, vLLM's ``vllm.general_plugins`` entry point) runs in every
process vLLM starts: the API server, the engine core and each worker. It only records where the backend class lives
and checks the preset; it imports neither the backend nor any CUDA state. vLLM imports the backend itself, once
``--attention-backend CUSTOM`` selects it (``TQ4AttentionBackend`` below resolves lazily, behind the version gate).

Importing this package is cheap (no torch, no vLLM): the names below resolve on first use. Modules: requirements
(the vLLM releases and GPUs supported, the version gate), settings (preset, calibration, environment,
--additional-config), compat (vLLM's API surface, behind the gate), kv_spec (compressed KV-cache specs), backend,
metadata (builder), impl, calibrate.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import TQ4AttentionBackend

__all__ = [
    "BACKEND_PATH", "CALIBRATION_CONFIG_KEY", "CALIBRATION_ENV", "PRESET_CONFIG_KEY", "PRESET_ENV",
    "TQ4AttentionBackend", "register", "resolve_calibration_path", "resolve_preset",
]

# The path vLLM resolves for AttentionBackendEnum.CUSTOM. It names this package, not the
# backend module, so that the version gate runs before any version-specific import.
BACKEND_PATH = "turboquant_vllm.vllm.TQ4AttentionBackend"

_registered = False


def register() -> None:
    """Make ``--attention-backend CUSTOM`` ours.

    Idempotent, cheap and CUDA-free: it runs in every vLLM process, whether or not the backend
    is selected. An unknown ``TURBOQUANT_PRESET`` fails here, at startup; a vLLM outside the
    tested range only warns here (other backends keep working) and fails with the range named
    as soon as the CUSTOM backend is resolved.
    """
    global _registered
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from .settings import logger, resolve_preset

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    if _registered:
        return
    preset = resolve_preset(None)  # raises ValueError naming the valid presets
    _registered = True
    # The version gate alone: compat's imports of vLLM's attention internals (~0.35 s, ~200 modules in a process that
    # never attends, e.g. the API server) wait until the backend resolves.
    from .requirements import UnsupportedVLLMVersion, check_vllm_version

    try:
        version = check_vllm_version()
        logger.debug("turboquant-vllm registered as the CUSTOM attention backend (vLLM %s, preset %s)", version,
                     preset.name)
    except UnsupportedVLLMVersion as exc:
        logger.warning("turboquant-vllm: %s", exc)


_SETTINGS = {"CALIBRATION_CONFIG_KEY", "CALIBRATION_ENV", "PRESET_CONFIG_KEY", "PRESET_ENV", "resolve_calibration_path",
             "resolve_preset"}


def __getattr__(name: str) -> Any:
    if name in _SETTINGS:
        return getattr(importlib.import_module(".settings", __name__), name)
    if name == "TQ4AttentionBackend":
        from . import compat

        compat.check_vllm_version()  # clear refusal, naming the tested range
        from .backend import TQ4AttentionBackend

        return TQ4AttentionBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
