"""Model ports for vLLM, one subpackage each (registered from turboquant_vllm.plugins)."""
