"""AWQ int4 checkpoints served through TurboMind's GEMM kernels (`-q awq_turbomind`).

`awq_format`: AutoAWQ's GEMM checkpoint format in plain PyTorch (pack / unpack, dequantize, round-to-nearest
quantization): the reference the kernel path is checked against. `checkpoint`: writes AWQ checkpoints (a trained
model's weights quantized, or random codes of any shape) for the tests and benchmarks.
"""
