"""The benchmarks, one module each, run from the repository root by one runner:

    python -m benchmarks                  # lists them
    python -m benchmarks <name> [args]    # runs one (as does python -m benchmarks.<name> [args])

Each module has a main(argv=None); benchmarks.common holds what they share (result paths, the provenance every
result file records, timing, plots), benchmarks.engine_rows the runner of those whose rows are whole vLLM engines
(awq, weights). Results: benchmarks/results/<name>/<gpu>-<what>.<ext>, except the headline summaries
benchmarks/results/{e2e,quality,awq,decode_sweep}.{json,md,png}; benchmarks/results/README.md indexes the current
ones. The modes that render a result file (quality --report, decode_sweep --report) print it and write files only to
an explicit --out. benchmarks.serving_common holds what serving_soak and serving_spec_decode share with the serving
GPU tests (tests/serving); both write into benchmarks/results/serving/.
"""

# name -> one line: what it measures. Importing this package stays light (no torch): the runner lists these.
BENCHMARKS = {
    "decode_kernel": "decode attention alone: our presets vs FlashAttention-3 bf16 / fp8 and vLLM's in-tree TurboQuant "
                     "(GPU, CUDA-graph replay)",
    "decode_sweep": "decode attention over query-head groups, head dims, batches and contexts: tq4 vs FlashAttention-3 "
                    "bf16 / fp8, heat map and targets (GPU; --report prints a result on a CPU)",
    "e2e": "vLLM end to end per KV cache: KV tokens that fit, decode and prefill throughput, requests/s at the memory "
           "limit (GPU)",
    "prefill_attention": "one layer's prefill step: store + attention, ours vs FLASH_ATTN bf16 (GPU)",
    "store_kernel": "the store kernel (rotate, quantize, pack, scatter) per batch size and tile configuration (GPU)",
    "profile_decode": "GPU time per decode step by kernel, per KV cache, under torch.profiler (GPU)",
    "layer_step": "one layer's decode-step attention, ours vs FLASH_ATTN: the host's time to issue it (eager) and the "
                  "GPU's (graph replay) (GPU)",
    "quality": "quality per KV cache in real vLLM: perplexity, pass-key retrieval, KL vs bf16, bytes per token "
               "(GPU; --report prints a result on a CPU)",
    "awq_gemm": "AWQ int4 GEMM: TurboMind's kernels vs vLLM's AWQ kernels and the dense matmul, per layer shape and "
                "token count (GPU)",
    "nvfp4_gemm": "NVFP4 weight GEMM (W4A16): quartet2's marlin path (Marlin, the weight decoded for cuBLAS, the "
                  "policy) vs the bf16 matmul, per layer shape and token count (GPU)",
    "profile_weights": "where a decode step's time goes per weight method (bf16, quartet2, modelopt_fp4, AWQ "
                       "kernels) in vLLM with CUDA graphs: wall, GEMM, attention and other GPU time (GPU)",
    "awq": "AWQ int4 serving in vLLM end to end: output tok/s and batch-1 decode latency per AWQ kernel (Machete, "
           "Marlin, Triton, TurboMind) on a Llama-3-8B-shaped checkpoint (GPU)",
    "weights": "weight quantization in vLLM end to end vs bf16 weights: output tok/s and batch-1 decode latency of "
               "quartet2 (NVFP4 through Marlin FP4) and vLLM's fp8 on a Llama-3-8B-shaped model (GPU)",
    "serving_soak": "`vllm serve` SmolLM2-135M under `vllm bench serve` per KV cache (tq4, tq3, FLASH_ATTN bf16), "
                    "preemption on: failed requests, latency percentiles, output tok/s, GPU memory (GPU)",
    "serving_spec_decode": "speculative decoding vs greedy decoding on the same backend with CUDA graphs: identical "
                           "outputs against a rebatching control, acceptance rate, speed-up (GPU)",
}
