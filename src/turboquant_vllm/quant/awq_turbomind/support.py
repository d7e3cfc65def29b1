"""What `awq_turbomind` runs (TurboMind 0.0.2's int4 GEMM kernels) and the lines that refuse the rest, with the way
out: shared by its config (config.py) and its layers (method.py), neither importing the other's side. No vLLM.
"""

from __future__ import annotations

import os
from typing import Any

from .awq_format import BITS

NAME = "awq_turbomind"
OPT_IN_ENV = "TURBOQUANT_AWQ_TURBOMIND"
# this source tree's extra: "turboquant-vllm" on PyPI is another project
INSTALL = 'pip install ".[turbomind]" (run from the turboquant-vllm source tree)'
GROUP_SIZES = (128,)  # turbomind 0.0.2: Linear() refuses others, and its kernels are all "u4g128"
MIN_CAPABILITY = 70  # its oldest kernels are sm70 (Volta) tensor-core ones
WAY_OUT = (f"Serve it with vLLM's own AWQ kernels instead: without -q {NAME}, and with {OPT_IN_ENV} unset")


def opted_in() -> bool:
    return os.environ.get(OPT_IN_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def is_awq(cfg: dict[str, Any] | None) -> bool:
    return bool(cfg) and str(cfg.get("quant_method", "")).lower() == "awq"


def refusal(bits: Any, group_size: Any, zero_point: Any, version: str, lm_head: bool = False) -> str | None:
    """Why TurboMind cannot run a checkpoint of this AWQ configuration (with the way out), or None."""
    if version != "gemm":
        return f"{NAME} reads AutoAWQ's GEMM format (version \"gemm\"); this checkpoint is version {version!r}. " \
               f"{WAY_OUT}."
    if bits != BITS:
        return f"{NAME} runs 4-bit AWQ only (TurboMind's kernels are int4); this checkpoint has bits={bits}. {WAY_OUT}."
    if group_size not in GROUP_SIZES:
        return f"{NAME}: TurboMind 0.0.2 has int4 kernels for group size {', '.join(map(str, GROUP_SIZES))} only; " \
               f"this checkpoint has group_size={group_size}. {WAY_OUT}."
    if not zero_point:
        return f"{NAME} reads AWQ's zero points (zero_point: true); this checkpoint is symmetric (zero_point: " \
               f"{zero_point}). {WAY_OUT}."
    if lm_head:
        return f"{NAME} runs the decoder's linear layers; this checkpoint also quantizes lm_head. {WAY_OUT}."
    return None
