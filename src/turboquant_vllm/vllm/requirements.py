"""What the KV-cache plugin needs to serve: the vLLM releases it supports and the GPUs it runs on; the version gate.

Imports no vLLM (the CLI asks it before vLLM is known to be installed). compat runs the gate before it touches any
vLLM internal; ``TURBOQUANT_ALLOW_UNSUPPORTED_VLLM=1`` turns the refusal into a warning.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import re

logger = logging.getLogger("vllm.turboquant_vllm")

SUPPORTED_VLLM = ">=0.33,<0.34"
TESTED_VLLM = "0.33.0"
_LOWER, _UPPER = (0, 33), (0, 34)
ALLOW_UNSUPPORTED_ENV = "TURBOQUANT_ALLOW_UNSUPPORTED_VLLM"
MIN_COMPUTE_CAPABILITY = 80  # bf16 tl.dot: Ampere (8.0) or newer


class UnsupportedVLLMVersion(RuntimeError):
    """vLLM outside the range this plugin was written and tested against (a RuntimeError, so that vLLM's backend
    selector does not swallow it as an ImportError)."""


def installed_vllm_version() -> str | None:
    """The version of the vLLM Python would import here, None if none is importable; imports nothing."""
    try:
        if importlib.util.find_spec("vllm") is None:
            return None
    except (ImportError, ValueError):  # ValueError: sys.modules["vllm"] is None (imports of it are blocked)
        return None
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def is_supported_vllm(version: str) -> bool:
    match = re.match(r"v?(\d+)\.(\d+)", version.strip())
    return bool(match) and _LOWER <= (int(match[1]), int(match[2])) < _UPPER


def check_vllm_version(version: str | None = None) -> str:
    """Return the vLLM version, or raise UnsupportedVLLMVersion naming the supported range."""
    version = version or installed_vllm_version() or "not installed"
    if is_supported_vllm(version):
        return version
    message = (
        f"turboquant-vllm supports vLLM {SUPPORTED_VLLM} (tested with {TESTED_VLLM}); found vLLM {version}. "
        f"Install a supported vLLM (pip install 'vllm{SUPPORTED_VLLM}') or serve without "
        f"--attention-backend CUSTOM. ({ALLOW_UNSUPPORTED_ENV}=1 skips this check, at your own risk.)"
    )
    if os.environ.get(ALLOW_UNSUPPORTED_ENV) == "1":
        logger.warning("%s", message)
        return version
    raise UnsupportedVLLMVersion(message)
