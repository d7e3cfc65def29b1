"""vLLM plugin: serve from a TurboQuant-compressed paged KV cache.

    pip install turboquant-vllm
    TURBOQUANT_PRESET=tq4 vllm serve MODEL --attention-backend CUSTOM

vLLM runs ``register()`` (entry point group ``vllm.general_plugins``) in every process it starts:
the API server, the engine core and each worker. ``register()`` only records where the backend
class lives and checks the preset; it imports neither the backend nor any CUDA state. The
backend module is imported by vLLM itself, in the workers, once ``--attention-backend CUSTOM``
selects it (``TQ4AttentionBackend`` below resolves lazily).

The preset comes from ``--additional-config '{"turboquant_preset": "tq3"}'`` or from the
environment variable ``TURBOQUANT_PRESET`` (default ``tq4``); giving both with different values
is an error. A key calibration file (``turboquant-vllm calibrate``, see core.calibration) comes
the same way: ``turboquant_key_calibration`` or ``TURBOQUANT_KEY_CALIBRATION``.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..core.presets import Preset
    from .backend import TQ4AttentionBackend

__all__ = [
    "BACKEND_PATH", "CALIBRATION_CONFIG_KEY", "CALIBRATION_ENV", "PRESET_CONFIG_KEY", "PRESET_ENV",
    "TQ4AttentionBackend", "register", "resolve_calibration_path", "resolve_preset",
]

# The path vLLM resolves for AttentionBackendEnum.CUSTOM. It names this package, not the
# backend module, so that the version gate below runs before any version-specific import.
BACKEND_PATH = "turboquant_vllm.vllm.TQ4AttentionBackend"
PRESET_ENV = "TURBOQUANT_PRESET"
PRESET_CONFIG_KEY = "turboquant_preset"  # key of vLLM's --additional-config
CALIBRATION_ENV = "TURBOQUANT_KEY_CALIBRATION"
CALIBRATION_CONFIG_KEY = "turboquant_key_calibration"
# Set by `turboquant-vllm calibrate` only: the backend then sums key/query statistics per layer.
COLLECT_ENV = "TURBOQUANT_COLLECT_KEY_STATISTICS"

# A child of vLLM's "vllm" logger, so our lines come out through vLLM's handler and format.
logger = logging.getLogger("vllm.turboquant_vllm")

_registered = False


def register() -> None:
    """Entry point of ``vllm.general_plugins``: make ``--attention-backend CUSTOM`` ours.

    Idempotent, cheap and CUDA-free: it runs in every vLLM process, whether or not the backend
    is selected. An unknown ``TURBOQUANT_PRESET`` fails here, at startup; a vLLM outside the
    tested range only warns here (other backends keep working) and fails with the range named
    as soon as the CUSTOM backend is resolved.
    """
    global _registered
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    if _registered:
        return
    preset = resolve_preset(None)  # raises ValueError naming the valid presets
    _registered = True
    try:
        from . import compat  # the version gate: raises outside the tested range

        logger.debug("turboquant-vllm registered as the CUSTOM attention backend (vLLM %s, preset %s)",
                     compat.installed_vllm_version(), preset.name)
    except (RuntimeError, ImportError) as exc:  # the gate's UnsupportedVLLMVersion, or a moved vLLM API
        logger.warning("turboquant-vllm: %s", exc)


def resolve_preset(vllm_config: Any | None = None) -> "Preset":
    """The preset this process serves with: ``--additional-config`` key, else ``TURBOQUANT_PRESET``, else tq4."""
    from ..core.presets import DEFAULT_PRESET, get_preset

    config_value, env_value = _setting(vllm_config, PRESET_CONFIG_KEY, PRESET_ENV)
    try:
        if config_value and env_value and get_preset(config_value) != get_preset(env_value):
            raise ValueError(
                f"TurboQuant preset given twice: --additional-config {PRESET_CONFIG_KEY}={config_value!r} and "
                f"{PRESET_ENV}={env_value!r}; keep one of them"
            )
        return get_preset(config_value or env_value or DEFAULT_PRESET)
    except ValueError as exc:
        source = f"--additional-config {PRESET_CONFIG_KEY}" if config_value else PRESET_ENV
        raise ValueError(f"{source}: {exc}") from None


def _setting(vllm_config: Any | None, config_key: str, env: str) -> tuple[str | None, str | None]:
    extra = getattr(vllm_config, "additional_config", None)
    config_value = None
    if isinstance(extra, dict) and extra.get(config_key) is not None:
        config_value = str(extra[config_key]).strip() or None
    return config_value, os.environ.get(env, "").strip() or None


def resolve_calibration_path(vllm_config: Any | None = None) -> str | None:
    """The key calibration file: ``--additional-config`` key, else ``TURBOQUANT_KEY_CALIBRATION``, else none."""
    config_value, env_value = _setting(vllm_config, CALIBRATION_CONFIG_KEY, CALIBRATION_ENV)
    if config_value and env_value and os.path.abspath(config_value) != os.path.abspath(env_value):
        raise ValueError(
            f"TurboQuant key calibration given twice: --additional-config {CALIBRATION_CONFIG_KEY}={config_value!r} "
            f"and {CALIBRATION_ENV}={env_value!r}; keep one of them"
        )
    return config_value or env_value


def __getattr__(name: str) -> Any:
    if name == "TQ4AttentionBackend":
        from . import compat

        compat.check_vllm_version()  # clear refusal, naming the tested range
        from .backend import TQ4AttentionBackend

        return TQ4AttentionBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
