"""turboquant-vllm: TurboQuant-compressed KV cache for vLLM."""

from importlib.metadata import PackageNotFoundError, version

# This project's mark. PyPI's "turboquant-vllm" is a different project with the same import name (turboquant_vllm):
# `turboquant-vllm verify` reads this line (without importing) to tell which of them Python imports. Keep it as is.
PROJECT_MARK = "turboquant-vllm: TurboQuant KV cache plugin with Triton kernels (core / ops / vllm / plugins)"

try:
    __version__ = version("turboquant-vllm")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0"
