"""GPU: per-layer presets end to end in vLLM (skipped without CUDA).

A small Llama with random weights (4 layers, head_dim 128, 8 query / 2 KV heads, bf16), KV-cache memory fixed with
kv_cache_memory_bytes, served by vLLM in its own process per configuration:
- every layer bf16 on --attention-backend CUSTOM gives FLASH_ATTN's log-probabilities and its number of blocks;
- mixed presets (layers 0 and -1 bf16, layer 1 k4v3, layer 2 the preset tq4) give log-probabilities that match a
  PyTorch reference quantizing each layer's K/V with its own preset, clearly closer to it than to no quantization or
  to tq4 in every layer;
- memory is exact: vLLM's block count is the memory // the sum of the layers' own pages (no padding);
- torch.compile with CUDA graphs (vLLM's defaults), the presets from the environment, matches the reference as
  well, and no kernel of ours compiles inside a request;
- the startup line names each layer's preset.

    source .gpukit/bin/env.sh && python3 tests/vllm/test_gpu_layer_presets.py     # or pytest -m gpu
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from functools import cache
from pathlib import Path

import torch

try:
    import pytest

    pytestmark = pytest.mark.gpu
except ImportError:  # the GPU image may lack pytest: run as a script
    pytest = None

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script too: the helpers below import tests.vllm

from tests.vllm.gpu_report import OUR_KERNELS, exit_with, module_checks, run_checks  # noqa: E402

HEAD_DIM, Q_HEADS, KV_HEADS, LAYERS, BLOCK = 128, 8, 2, 4, 16
MIXED = {"0,-1": "bf16", "1": "k4v3"}  # layer 2 keeps the preset, tq4
PER_LAYER = [None, "k4v3", "tq4", None]  # the same, for the reference (None: unquantized)
KV_BYTES = (64 << 20) + 12345  # not a multiple of any page
PROMPT_LENS, GENERATED = (300, 260, 220), 8
RUNS = {
    "flash": {"backend": "FLASH_ATTN", "llm": {"enforce_eager": True}},
    "all_bf16": {"llm": {"enforce_eager": True, "additional_config": {"turboquant_layer_presets": {"0--1": "bf16"}}}},
    "mixed": {"llm": {"enforce_eager": True, "additional_config": {"turboquant_layer_presets": MIXED}}},
    "mixed_compiled": {"llm": {}, "env": {"TURBOQUANT_LAYER_PRESETS": "0,-1=bf16;1=k4v3"}},  # vLLM's defaults
}

ENGINE = """
import json, sys
from vllm import LLM, SamplingParams
a = json.loads(sys.argv[1])
llm = LLM(model=a["model"], skip_tokenizer_init=True, seed=0, attention_config={"backend": a["backend"]},
          max_model_len=1024, block_size=a["block"], kv_cache_memory_bytes=a["kv_bytes"], enable_prefix_caching=False,
          **a["llm"])
params = SamplingParams(max_tokens=a["generated"], temperature=0.0, ignore_eos=True, logprobs=0, prompt_logprobs=0,
                        detokenize=False)
outs = llm.generate([{"prompt_token_ids": p} for p in a["prompts"]], params, use_tqdm=False)
runs = [dict(prompt=[None if d is None else d[t].logprob for d, t in zip(o.prompt_logprobs, p)],
             tokens=list(o.outputs[0].token_ids),
             decode=[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
        for o, p in zip(outs, a["prompts"])]
print("RESULT " + json.dumps(dict(runs=runs, blocks=llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)),
      flush=True)
"""


@cache
def model() -> tuple[Path, dict, list[list[int]]]:
    from tests.vllm.test_gpu_logits import VOCAB, make_model

    path = Path(tempfile.mkdtemp(prefix="tq-layer-presets-")) / "model"
    weights = make_model(path, HEAD_DIM, Q_HEADS, KV_HEADS, "bfloat16", layers=LAYERS)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return path, weights, prompts


_done: dict[str, dict] = {}  # finished runs, for the script's summary


@cache
def run(name: str) -> dict:
    from tests.vllm.test_gpu_serving import workdir  # its site folder registers the plugin

    spec = RUNS[name]
    path, _, prompts = model()
    env = dict(os.environ, **spec.get("env", {}))
    env.pop("TURBOQUANT_PRESET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(workdir() / "site"), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    args = {"model": str(path), "prompts": prompts, "generated": GENERATED, "backend": spec.get("backend", "CUSTOM"),
            "block": BLOCK, "kv_bytes": KV_BYTES, "llm": spec["llm"]}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(ENGINE), json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    log = done.stdout + done.stderr
    (path.parent / f"{name}.log").write_text(log)
    assert done.returncode == 0, f"{name} failed:\n{log[-6000:]}"
    result = json.loads(next(line for line in log.splitlines() if line.startswith("RESULT "))[7:])
    result["startup"] = [line.split("] ", 1)[-1] for line in log.splitlines() if "TurboQuant KV cache per" in line]
    result["jit"] = sorted(set(re.findall(r"JIT compilation during inference: (\w+)", log)))
    _done[name] = result
    return result


def logprobs(result: dict) -> torch.Tensor:
    """Prompt log-probs of tokens 1.. then the generated tokens', every prompt in turn."""
    return torch.tensor([x for r in result["runs"] for x in r["prompt"][1:] + r["decode"]])


def errors(result: dict, presets) -> torch.Tensor:
    """|vLLM - reference| per scored token, the reference quantizing layer i's K/V with presets[i]."""
    from tests.vllm.test_gpu_logits import reference_logprobs

    _, weights, prompts = model()
    out = []
    for p, r in zip(prompts, result["runs"]):
        ours = torch.tensor(r["prompt"][1:] + r["decode"], device="cuda")
        out.append((ours - reference_logprobs(weights, p + r["tokens"], presets)[: len(ours)]).abs().cpu())
    return torch.cat(out)


def page_bytes(preset: str | None) -> int:
    from turboquant_vllm.core.layout import CacheLayout
    from turboquant_vllm.core.presets import get_preset

    if preset is None:  # bf16: K and V, 2 bytes each
        return BLOCK * KV_HEADS * 2 * HEAD_DIM * 2
    return CacheLayout(get_preset(preset), HEAD_DIM, KV_HEADS, BLOCK).page_bytes


def test_all_bf16_layers_are_flash_attention():
    flash, ours = run("flash"), run("all_bf16")
    assert (logprobs(ours) - logprobs(flash)).abs().max() < 1e-3
    assert [r["tokens"] for r in ours["runs"]] == [r["tokens"] for r in flash["runs"]]
    assert ours["blocks"] == flash["blocks"] == KV_BYTES // (LAYERS * page_bytes(None))


def test_memory_is_exactly_each_layers_page():
    per_block = sum(page_bytes(p) for p in PER_LAYER)
    assert run("mixed")["blocks"] == KV_BYTES // per_block
    assert run("mixed")["blocks"] > KV_BYTES // (LAYERS * page_bytes(None))  # not padded to the bf16 page


def check_against_reference(result: dict) -> None:
    """vLLM ran each layer's own preset: clearly closer to that reference than to no quantization or to tq4 in every
    layer (the gap left is bf16 rounding, amplified where a rounded key lands across a code boundary). Each run is
    scored on its own tokens, so runs whose greedy tokens part ways still compare."""
    err, err_fp, err_tq4 = errors(result, PER_LAYER), errors(result, None), errors(result, "tq4")
    report = {"mean_vs_reference": err.mean().item(), "max_vs_reference": err.max().item(),
              "mean_vs_unquantized": err_fp.mean().item(), "mean_vs_tq4_everywhere": err_tq4.mean().item()}
    result["report"] = report
    assert report["mean_vs_reference"] < 0.6 * report["mean_vs_unquantized"], report
    assert report["mean_vs_reference"] < 0.8 * report["mean_vs_tq4_everywhere"], report
    assert report["max_vs_reference"] < 1.0, report  # no outliers (a wrong page or layout would be > 1)


def test_mixed_presets_match_their_reference():
    check_against_reference(run("mixed"))


def test_compiled_with_cuda_graphs_matches_too():
    compiled = run("mixed_compiled")
    assert compiled["blocks"] == run("mixed")["blocks"]
    check_against_reference(compiled)


def test_no_kernel_of_ours_compiles_inside_a_request():
    for name in ("mixed", "mixed_compiled"):
        assert not [k for k in run(name)["jit"] if k in OUR_KERNELS], (name, run(name)["jit"])


def test_startup_line_names_each_layers_preset():
    for name in ("mixed", "mixed_compiled"):
        assert any("bf16 0,3; k4v3 1; tq4 2:" in line for line in run(name)["startup"]), run(name)["startup"]


if __name__ == "__main__":
    report = run_checks(module_checks(dict(globals())), sys.argv[1:])
    summary = {name: {k: v for k, v in r.items() if k != "runs"} for name, r in _done.items()}
    exit_with(report, runs=summary, logs=str(model()[0].parent))
