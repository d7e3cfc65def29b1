"""GPU: `-q awq_turbomind` in a vLLM engine against vLLM's own AWQ paths on the same checkpoint.

A random Llama-3-8B-shaped AWQ checkpoint (4 layers, written by the package's own helper): greedy tokens of random
prompts as awq_marlin's.

The reference LM (trained, hidden 512) quantized to AWQ int4 group 128 by our helper: WikiText-2 perplexity under
awq_turbomind within 0.5% of vLLM's `awq_marlin` and `awq` (Triton), and greedy continuations that follow
awq_marlin's (fp16 kernels summing in other orders may part at a near-tie, so most, not all, must agree to the end).
Compiled with CUDA graphs (vLLM's default), fp16 (AWQ's kernels' dtype); at tensor parallel 1 and, with two GPUs, 2.

    source .gpukit/bin/env.sh && python -m pytest -q -s tests/quant/awq_turbomind/test_gpu_engine.py
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.quant import gpu_engine

pytestmark = pytest.mark.gpu
MODEL = gpu_engine.ROOT / "models" / "reference-lm"
WINDOWS, WINDOW, PROMPTS, PROMPT, GENERATED = 16, 1024, 16, 64, 48


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from turboquant_vllm.quant.awq_turbomind import checkpoint

    return checkpoint.quantize_checkpoint(MODEL, tmp_path_factory.mktemp("awq") / "reference-lm-awq")


@pytest.mark.parametrize("tp", [1, 2])
def test_awq_turbomind_serves_as_vllms_awq_kernels_do(checkpoint, tp):
    pytest.importorskip("turbomind")
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA GPU(s)")
    windows, prompts = gpu_engine.windows_and_prompts(MODEL, WINDOWS, WINDOW, PROMPTS, PROMPT)
    # tensor parallel 2: each rank repacks and runs its own shard of every layer
    llm = dict(dtype="float16", **({"tensor_parallel_size": tp} if tp > 1 else {}))
    runs = {q: gpu_engine.serve(checkpoint, dict(quantization=q, **llm), windows, prompts, GENERATED)
            for q in ("awq_marlin", "awq", "awq_turbomind")}
    ppl = {q: r["ppl"] for q, r in runs.items()}
    agree = [gpu_engine.same_prefix(a, b) for a, b in zip(runs["awq_turbomind"]["tokens"],
                                                          runs["awq_marlin"]["tokens"])]
    print(f"\ntensor parallel {tp}: perplexity over {WINDOWS} x {WINDOW} WikiText-2 tokens: "
          + ", ".join(f"{q} {p:.4f}" for q, p in ppl.items()))
    print(f"greedy tokens shared with awq_marlin, per prompt (of {GENERATED}): {agree}")
    for q in ("awq_marlin", "awq"):
        assert abs(ppl["awq_turbomind"] / ppl[q] - 1) < 0.005, (q, ppl)
    assert sum(a == GENERATED for a in agree) >= PROMPTS * 3 // 4 and min(agree) >= 8, agree


def test_a_random_llama_checkpoint_decodes_as_awq_marlin_does(tmp_path):
    pytest.importorskip("turbomind")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from turboquant_vllm.quant.awq_turbomind import checkpoint

    from benchmarks.engine_rows import LLAMA3_8B, llama3_8b

    layers, count, prompt, generated = 4, 16, 64, 32
    config = llama3_8b(dict(LLAMA3_8B, torch_dtype="float16"), layers, prompt, generated)
    path = checkpoint.random_checkpoint(config, tmp_path / "llama3-8b-4l-awq")
    rng = random.Random(0)
    ids = [[rng.randrange(3, config["vocab_size"]) for _ in range(prompt)] for _ in range(count + 1)]
    runs = {q: gpu_engine.serve(path, dict(quantization=q, dtype="float16"), ids[:1], ids[1:], generated)
            for q in ("awq_marlin", "awq_turbomind")}
    agree = [gpu_engine.same_prefix(a, b) for a, b in zip(runs["awq_turbomind"]["tokens"],
                                                          runs["awq_marlin"]["tokens"])]
    print(f"\nrandom Llama-3-8B shape, {layers} layers: greedy tokens shared with awq_marlin, per prompt (of "
          f"{generated}): {agree}")
    assert sum(a == generated for a in agree) >= count * 3 // 4 and min(agree) >= 8, agree
