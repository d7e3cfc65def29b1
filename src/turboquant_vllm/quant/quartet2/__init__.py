"""Quartet II NVFP4 quantization on the fly (`-q quartet2`) for CloverLM and other bf16 checkpoints.

    nvfp4/    the math in plain PyTorch: the NVFP4 format, Quartet II's 4/6 rule, the blocked scale layout
    kernels/  one folder per op (quantize, dequantize, the GEMM paths emulate, w4a4, marlin, marlin_dequant,
              marlin_mma), each with its plain-PyTorch reference (naive.py) beside it
    plugin/   the vLLM method: config, linear layers, the path choice, CloverLM's NVFP4 checkpoints

Each imports only those above it: nvfp4 <- kernels <- plugin.
"""


def register() -> None:
    """`-q quartet2` for vLLM, from the package's vllm.general_plugins entry point: cheap (the config class registers
    from its light module; its layers and kernels load when vLLM builds it)."""
    from .plugin.config import register as register_method

    register_method()
