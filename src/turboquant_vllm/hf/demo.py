"""The demo's transformers side: tokenize its prompts and text, then run a model with DynamicCache (the model's own
K/V) and with TurboQuantCache: greedy continuations and the perplexity of a WikiText-2 excerpt.

The report and the verdict live in cli/demo.py, which also runs the same measurements through vLLM on a GPU.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

EXCERPT = Path(__file__).resolve().parent / "data" / "wikitext2-excerpt.txt"
# bf16 matmuls on a CPU run far slower than fp32 ones; the weights (bf16 on disk) convert exactly.
CPU_DTYPE = torch.float32


def wikitext_excerpt() -> str:
    """The excerpt's text, without its first line (the attribution)."""
    return EXCERPT.read_text(encoding="utf-8").split("\n", 1)[1]


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """A user turn through the model's chat template, ready for the assistant's answer."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def text_ids(tokenizer, text: str, max_tokens: int) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]


def stop_ids(model_dir: str | Path, tokenizer) -> list[int]:
    """The token ids that end an answer: the generation config's EOS (one id or several), else the tokenizer's."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    eos = tokenizer.eos_token_id if eos is None else eos
    return sorted({eos} if isinstance(eos, int) else set(eos or []))


def load_shape(model_dir: str | Path) -> dict:
    """Layers, KV heads and head_dim of the model's (text) attention."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(str(model_dir)).get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return {"layers": text.num_hidden_layers, "kv_heads": text.num_key_value_heads, "head_dim": head_dim}


def with_cache(model, cache) -> dict:
    """The keyword argument that hands a Cache to the model: `cache` in recent transformers, `past_key_values`
    before it was renamed."""
    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


@torch.no_grad()
def continuation(model, prompt: list[int], tokens: int, cache, eos: list[int]) -> tuple[list[int], bool]:
    """The greedy new tokens (an EOS included) and whether every step's logits were finite."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos[0] if eos else None, return_dict_in_generate=True,
                         output_logits=True, **with_cache(model, cache))
    return out.sequences[0, len(prompt):].tolist(), all(bool(torch.isfinite(step).all()) for step in out.logits)


@torch.no_grad()
def negative_log_likelihood(model, window: list[int], cache) -> float:
    """-sum log p(token t | tokens before t) over window[1:], one forward pass through the cache."""
    ids = torch.tensor([window], device=model.device)
    logits = model(ids, use_cache=True, **with_cache(model, cache)).logits[0, :-1].float()
    return -logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).sum().item()


def measure(model, label: str, make_cache: Callable[[], object], prompts: list[list[int]], windows: list[list[int]],
            tokens: int, eos: list[int]) -> dict:
    """One cache's results, in the form cli/demo.py reports for every engine."""
    start = time.perf_counter()
    continuations, finite = [], True
    for prompt in prompts:
        new, ok = continuation(model, prompt, tokens, make_cache(), eos)
        continuations.append(new)
        finite &= ok
    nll, stored = 0.0, None
    for window in windows:
        cache = make_cache()
        nll += negative_log_likelihood(model, window, cache)
        if stored is None and hasattr(cache, "nbytes"):
            stored = {"tokens": len(window), "bytes": cache.nbytes()}
    finite &= math.isfinite(nll)
    return {"label": label, "continuations": continuations, "nll": nll, "scored": sum(len(w) - 1 for w in windows),
            "finite": finite, "seconds": time.perf_counter() - start, "stored": stored}


def run(model_dir: str | Path, preset: str, prompts: list[list[int]], windows: list[list[int]], tokens: int,
        eos: list[int]) -> tuple[str, list[dict]]:
    """(engine description, [DynamicCache results, TurboQuantCache results]) on this machine's CPU."""
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.utils import logging

    from .cache import TurboQuantCache

    logging.set_verbosity_error()  # generate()'s notes on generation-config defaults
    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=CPU_DTYPE).eval()
    dtype = str(CPU_DTYPE).removeprefix("torch.")
    threads = torch.get_num_threads()
    engine = (f"transformers {transformers.__version__} on the CPU ({threads} thread{'s' * (threads > 1)}), {dtype} "
              "(bf16 matmuls are slow on CPUs)")
    results = [measure(model, f"DynamicCache ({dtype} K/V)", DynamicCache, prompts, windows, tokens, eos),
               measure(model, f"TurboQuantCache {preset}", lambda: TurboQuantCache(preset), prompts, windows, tokens,
                       eos)]
    return engine, results
