"""AWQ int4 checkpoints served through TurboMind's GEMM kernels (`-q awq_turbomind`).

`awq_format`: AutoAWQ's GEMM checkpoint format in plain PyTorch (pack / unpack, dequantize, round-to-nearest
quantization): the reference the kernel path is checked against. `checkpoint`: writes AWQ checkpoints (a trained
model's weights quantized, or random codes of any shape) for the tests and benchmarks. `config`: the vLLM
quantization method `awq_turbomind`'s config, made known to vLLM by `register`; `method`: its TurboMind layers.
"""


def register() -> None:
    """`-q awq_turbomind` for vLLM, from the package's vllm.general_plugins entry point: cheap and CUDA-free (the
    config class registers from its light module; turbomind, vLLM's layers and the torch op are imported only when
    vLLM builds a config with the method). Registering again leaves one registration."""
    from .config import register as register_method

    register_method()
