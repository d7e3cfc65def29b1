"""quartet2 as a vLLM quantization method (`-q quartet2`):

    config.py      the config class vLLM's registry holds (light: no vLLM layers, no Triton), and `register`
    paths.py       the execution path for this GPU (w4a4, marlin or emulate) and why
    method.py      the linear layers: weights created, loaded, quantized (or read) and run on the chosen path
    checkpoint.py  CloverLM's NVFP4 checkpoints, read as they are

It imports the kernels (quartet2.kernels) and the math (quartet2.nvfp4), never the other way round.
"""
