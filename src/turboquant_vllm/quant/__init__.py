"""Weight-quantization methods for vLLM, one subpackage each (registered from turboquant_vllm.plugins)."""
