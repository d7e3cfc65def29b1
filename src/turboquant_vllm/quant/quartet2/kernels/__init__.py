"""quartet2's kernels, one folder per op, each with its plain-PyTorch reference (`naive.py`) beside it:

    quantize/        Quartet II's NVFP4 quantizer (Triton), bit for bit the nvfp4 reference; a weight's quantization
    dequantize/      NVFP4 codes x group scales (Triton), the emulation's exact products
    emulate/         the W4A4 GEMM emulated exactly (the `emulate` path, any GPU)
    w4a4/            the W4A4 GEMM through vLLM's CUTLASS NVFP4 GEMM (the `w4a4` path, Blackwell)
    marlin/          the W4A16 GEMM through vLLM's Marlin FP4 kernel (the `marlin` path), which by token count runs
    marlin_mma/      the few-token kernel (native CUDA, marlin_mma.cu) or
    marlin_dequant/  the weight decoded (Triton) for one cuBLAS call

marlin_layout.py holds Marlin's weight layout, which marlin_mma and marlin_dequant read. The kernels import the math
(quartet2.nvfp4), never the vLLM glue (quartet2.plugin). This file imports nothing: each op loads when it is used.
"""
