"""The package's one ``vllm.general_plugins`` entry point: registers each plugin with vLLM.

vLLM calls ``register()`` in every process it starts. Each plugin's own ``register`` is cheap and CUDA-free and
imports its heavy dependencies only when vLLM selects it, so one plugin's missing optional dependency never breaks
vLLM for users of the others: an ImportError is logged and the other plugins register. A setting the user got wrong
(e.g. an unknown TURBOQUANT_PRESET) still fails at startup, with its message.
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger("vllm.turboquant_vllm")

# plugin -> "module:function" registering it
PLUGINS = {
    "turboquant-kv-cache": "turboquant_vllm.vllm:register",  # --attention-backend CUSTOM
    "awq-turbomind": "turboquant_vllm.quant.awq_turbomind:register",  # -q awq_turbomind
    "quartet2": "turboquant_vllm.quant.quartet2:register",  # -q quartet2
    "cloverlm": "turboquant_vllm.models.cloverlm:register",  # architecture CloverLMForCausalLM
}


def register() -> None:
    for name, target in PLUGINS.items():
        module, function = target.split(":")
        try:
            register_plugin = getattr(importlib.import_module(module), function)
        except ImportError as exc:
            logger.warning("turboquant-vllm: plugin %s not registered: %s", name, exc)
            continue
        register_plugin()
