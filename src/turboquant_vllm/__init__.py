"""turboquant-vllm: TurboQuant-compressed KV cache for vLLM."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("turboquant-vllm")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0"
