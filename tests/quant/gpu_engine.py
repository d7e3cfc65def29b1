"""GPU: a vLLM engine serving a quantized checkpoint, for the quantization methods' engine tests.

Each engine runs in its own process (vLLM engines do not tear down cleanly in one). It scores fixed windows of real
text (WikiText-2 through the model's own tokenizer: perplexity from prompt log-probs) and decodes fixed prompts
greedily, compiled and with CUDA graphs unless the caller turns them off, in a fresh compile cache, and reports both
as JSON.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WIKITEXT = Path(os.environ.get("TURBOQUANT_WIKITEXT", ROOT.parent / "shared" / "data" / "wikitext2-test.txt"))

ENGINE = """
import json, math, sys
a = json.loads(sys.argv[1])
from turboquant_vllm import plugins
plugins.register()  # what vLLM's entry point does in an installed package; a source tree may lack the entry point
from vllm import LLM, SamplingParams
llm = LLM(model=a["model"], skip_tokenizer_init=True, seed=0, max_model_len=a["max_model_len"],
          gpu_memory_utilization=0.3, **a["llm"])
score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
outs = llm.generate([{"prompt_token_ids": w} for w in a["windows"]], score, use_tqdm=False)
nll = [-sum(d[t].logprob for d, t in zip(o.prompt_logprobs[1:], w[1:])) for o, w in zip(outs, a["windows"])]
greedy = SamplingParams(max_tokens=a["generated"], temperature=0.0, ignore_eos=True, detokenize=False)
outs = llm.generate([{"prompt_token_ids": p} for p in a["prompts"]], greedy, use_tqdm=False)
print("RESULT " + json.dumps(dict(nll=nll, tokens=[list(o.outputs[0].token_ids) for o in outs])), flush=True)
"""


def text_tokens(model: Path, count: int) -> list[int]:
    """The first `count` tokens of WikiText-2's test split, through the model's tokenizer."""
    from tokenizers import Tokenizer

    text = WIKITEXT.read_text(encoding="utf-8")[: count * 8]
    ids = Tokenizer.from_file(str(model / "tokenizer.json")).encode(text).ids
    assert len(ids) >= count, f"{WIKITEXT}: {len(ids)} tokens, {count} wanted"
    return ids[:count]


def windows_and_prompts(model: Path, windows: int, window: int, prompts: int, prompt: int):
    """WikiText-2's first tokens cut into `windows` scoring windows of `window` tokens, then `prompts` greedy prompts
    of `prompt` tokens."""
    ids = text_tokens(model, windows * window + prompts * prompt)
    rest = ids[windows * window:]
    return ([ids[i * window:(i + 1) * window] for i in range(windows)],
            [rest[i * prompt:(i + 1) * prompt] for i in range(prompts)])


def serve(model: Path, llm: dict, windows: list[list[int]], prompts: list[list[int]], generated: int,
          env: dict | None = None, timeout: int = 600) -> dict:
    """One engine over `model` with LLM(**llm): {"ppl", "nll", "tokens"}; a failed engine fails with its log tail."""
    args = dict(model=str(model), llm=llm, windows=windows, prompts=prompts, generated=generated,
                max_model_len=max(len(w) for w in windows + prompts) + generated + 8)
    with tempfile.TemporaryDirectory() as cache:  # vLLM's compile cache reused a stale artifact of older code
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(ENGINE), json.dumps(args)], capture_output=True,
                              text=True, timeout=timeout, env=dict(os.environ, VLLM_CACHE_ROOT=cache, **(env or {})))
    found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not found:
        raise AssertionError(f"engine {llm} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}")
    out = json.loads(found[-1][len("RESULT "):])
    out["ppl"] = math.exp(sum(out["nll"]) / sum(len(w) - 1 for w in windows))
    return out


def same_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy continuations share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
