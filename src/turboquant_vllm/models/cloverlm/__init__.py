"""CloverLM (IST-DASLab): the architecture in plain PyTorch (`reference`), checkpoints in its format (`checkpoint`)
and the vLLM port (`vllm_model`), checked against the reference.

`register()` is the plugin turboquant_vllm.plugins calls in every vLLM process: it names the model class by string
(vLLM imports vllm_model only when it builds a CloverLM), so registering stays cheap and CUDA-free.
"""

ARCH = "CloverLMForCausalLM"
MODEL_CLASS = f"{__name__}.vllm_model:CloverLMForCausalLM"


def register() -> None:
    """CloverLMForCausalLM for vLLM and model_type "cloverlm" for AutoConfig (what vLLM reads config.json with);
    idempotent."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from .config import MODEL_TYPE, CloverLMConfig

    AutoConfig.register(MODEL_TYPE, CloverLMConfig, exist_ok=True)
    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, MODEL_CLASS)
