"""Quartet II NVFP4 quantization on the fly (`-q quartet2`) for CloverLM and other bf16 checkpoints.

`nvfp4`: the forward quantizer in plain PyTorch (E2M1 codes, an E4M3 scale per 16 elements, an fp32 tensor scale,
the "4/6" choice per group): the reference every kernel path of the method is checked against. `quantize`: the same
quantizer as one Triton kernel, bit for bit the reference's (one tensor scale for weights, one per row for
activations). `linear`: NVFP4 linear layers emulated exactly (W4A4 numerics). `marlin`: the NVFP4 weights through
vLLM's Marlin FP4 kernel (W4A16, Hopper / Ampere). `w4a4`: weights and activations through vLLM's CUTLASS NVFP4 GEMM
(Blackwell; CPU-tested against the kernel's contract only). `checkpoint`: CloverLM's NVFP4 checkpoints (blocked
scales) read row-major. `method`: the vLLM quantization method (needs vLLM; registered by `method.register`).
"""
