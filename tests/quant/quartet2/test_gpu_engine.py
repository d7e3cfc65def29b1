"""GPU: `-q quartet2` in a vLLM engine: the reference LM (trained, bf16) served with its linear layers quantized to
NVFP4 on the fly, through the path `auto` picks (Hopper: Marlin FP4, W4A16) and through the exact W4A4 emulation,
with CUDA graphs. WikiText-2 perplexity stays near bf16's (NVFP4 weights cost a few percent on a small model; W4A4
more than W4A16), and the two paths' greedy continuations start alike.

    source .gpukit/bin/env.sh && python -m pytest -q -s tests/quant/quartet2/test_gpu_engine.py
"""

from __future__ import annotations

import pytest
import torch

from tests.quant import gpu_engine

pytestmark = pytest.mark.gpu
MODEL = gpu_engine.ROOT / "models" / "reference-lm"
WINDOWS, WINDOW, PROMPTS, PROMPT, GENERATED = 16, 1024, 8, 64, 32


def test_quartet2_serves_the_reference_lm():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    windows, prompts = gpu_engine.windows_and_prompts(MODEL, WINDOWS, WINDOW, PROMPTS, PROMPT)
    serve = lambda llm, env=None: gpu_engine.serve(MODEL, dict(dtype="bfloat16", **llm), windows, prompts,  # noqa: E731
                                                    GENERATED, env)
    runs = {"bf16": serve({}), "auto": serve(dict(quantization="quartet2")),
            "emulate": serve(dict(quantization="quartet2"), {"TURBOQUANT_QUARTET2_PATH": "emulate"})}
    ppl = {k: r["ppl"] for k, r in runs.items()}
    print(f"\nperplexity over {WINDOWS} x {WINDOW} WikiText-2 tokens: "
          + ", ".join(f"{k} {p:.4f}" for k, p in ppl.items()))
    print("greedy tokens shared with bf16:", [gpu_engine.same_prefix(a, b) for a, b in
                                              zip(runs["auto"]["tokens"], runs["bf16"]["tokens"])])
    assert ppl["bf16"] < ppl["auto"] < ppl["bf16"] * 1.10, ppl
    assert ppl["bf16"] < ppl["emulate"] < ppl["bf16"] * 1.15, ppl
