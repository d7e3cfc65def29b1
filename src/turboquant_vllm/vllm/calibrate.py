"""Make a key calibration file for a model: run it in vLLM over text, fit core.calibration's transform.

The model runs once through vLLM with our backend (the preset's cache, eager, in this process),
prompt-only over windows of the text; every attention layer sums its post-RoPE keys and its
queries as vLLM hands them over. Then each layer's mean and scale are fitted and saved.

    turboquant-vllm calibrate MODEL --text book.txt [more.txt | dir/] --out MODEL-keys.safetensors
    TURBOQUANT_KEY_CALIBRATION=MODEL-keys.safetensors vllm serve MODEL --attention-backend CUSTOM

Use text like what the model will serve, never the text you evaluate it on.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .settings import CALIBRATION_ENV, COLLECT_ENV, PRESET_CONFIG_KEY


def read_texts(paths: list[str | Path]) -> str:
    """Files as given; directories: their *.txt files, sorted."""
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.rglob("*.txt")) if p.is_dir() else [p]
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise ValueError(f"calibration text not found: {missing or paths}")
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


def token_windows(ids: list[int], window: int, max_tokens: int, bos: list[int]) -> list[list[int]]:
    """Non-overlapping windows of `window` tokens (BOS first if the model uses one), max_tokens in all."""
    step = window - len(bos)
    if len(ids) < step:
        raise ValueError(f"calibration text has {len(ids)} tokens, fewer than one window of {step}")
    count = max(1, min(len(ids) // step, max_tokens // window))
    return [bos + ids[i * step:(i + 1) * step] for i in range(count)]


def calibrate(model: str, texts: list[str | Path], out: str | Path, *, preset: str | None = None,
              max_tokens: int = 262_144, window: int = 2048, gpu_memory_utilization: float = 0.5, log=print) -> dict:
    """Collect statistics over the text with the cache of preset (None: the settings' preset), fit, save to out;
    returns a summary."""
    from ..core.calibration import save_calibration

    text = read_texts(texts)
    os.environ[COLLECT_ENV] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the workers' statistics live in this process
    os.environ.pop(CALIBRATION_ENV, None)  # statistics of the uncalibrated keys
    from vllm import LLM, SamplingParams

    from .settings import key_statistics

    t0 = time.perf_counter()
    llm = LLM(model=model, attention_config={"backend": "CUSTOM"}, enforce_eager=True, max_model_len=window + 1,
              gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=False,
              additional_config={PRESET_CONFIG_KEY: preset} if preset else {})
    tok = llm.get_tokenizer()
    bos = [tok.bos_token_id] if tok.bos_token_id is not None and tok.encode("a")[:1] == [tok.bos_token_id] else []
    windows = token_windows(tok(text, add_special_tokens=False)["input_ids"], window, max_tokens, bos)
    key_statistics.clear()
    llm.generate([{"prompt_token_ids": w} for w in windows], SamplingParams(max_tokens=1), use_tqdm=False)
    if not key_statistics:
        raise RuntimeError("no attention layer reported statistics: was the CUSTOM backend selected?")
    layers = {name: stats.fit() for name, stats in sorted(key_statistics.items())}
    tokens = sum(map(len, windows))
    summary = dict(model=str(model), layers=len(layers), tokens=tokens, windows=len(windows), window=window,
                   seconds=round(time.perf_counter() - t0, 1))
    save_calibration(out, layers, summary)
    log(f"key calibration of {len(layers)} layers from {tokens} tokens -> {out}")
    return summary
