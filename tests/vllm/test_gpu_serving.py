"""GPU end to end: real vLLM engines on --attention-backend CUSTOM (skipped without CUDA).

Each configuration runs in its own process (vLLM engines do not tear down cleanly in one):
a Llama-shaped model with dummy weights (16 layers, 16 query / 4 KV heads, head_dim 128), eight
prompts of 17..1500 tokens, 32 greedy tokens each. Checks:
- vLLM's "GPU KV cache size" is >= 3.7x FLASH_ATTN's for tq4 (and follows the preset);
- full CUDA graphs (FULL_DECODE_ONLY) give the tokens eager mode gives;
- the V2 model runner and chunked prefill (mixed batches) give the same tokens;
- no kernel of ours compiles inside a request (vLLM's JIT monitor logs each one): startup compiled them.

On the GPU machine (see shared/gpu/README.md for the kit):
    source .gpukit/bin/env.sh && python3 tests/vllm/test_gpu_serving.py [WORD...]   # or pytest -m gpu
(WORDs pick the tests whose names contain one of them, e.g. `kv graphs`, to fit a 10-minute call.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from functools import lru_cache
from pathlib import Path

try:
    import pytest

    pytestmark = pytest.mark.gpu
except ImportError:  # the GPU image may lack pytest: run as a script
    pytest = None

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script too: tests.vllm.gpu_report

from tests.vllm.gpu_report import OUR_KERNELS, exit_with, module_checks, run_checks  # noqa: E402

MODEL_CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=5632,
    num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=32000,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=10000.0, torch_dtype="bfloat16",
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
PROMPT_LENS = [17, 60, 130, 300, 520, 777, 1000, 1500]
GRAPHS = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8, 16]}
RUNS = {
    "flash": dict(backend="FLASH_ATTN", llm={"compilation_config": GRAPHS}),
    # the V1 runner (vLLM 0.33 picks V2 where it can)
    "tq4": dict(llm={"compilation_config": GRAPHS}, env={"VLLM_USE_V2_MODEL_RUNNER": "0"}),
    "tq4_eager": dict(llm={"enforce_eager": True}),
    "tq4_v2": dict(llm={"compilation_config": GRAPHS}, env={"VLLM_USE_V2_MODEL_RUNNER": "1"}),
    "tq4_chunked": dict(llm={"enforce_eager": True, "max_num_batched_tokens": 256, "enable_chunked_prefill": True}),
    "tq3": dict(llm={"enforce_eager": True}, env={"TURBOQUANT_PRESET": "tq3"}),
}

ENGINE = """
import json, random, sys
from vllm import LLM, SamplingParams
args = json.loads(sys.argv[1])
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(3, 32000) for _ in range(n)]} for n in args["lens"]]
llm = LLM(model=args["model"], load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
          gpu_memory_utilization=0.5, enable_prefix_caching=False, seed=0,
          attention_config={"backend": args["backend"]}, **args["llm"])
outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, detokenize=False))
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
"""


@lru_cache(maxsize=None)
def workdir() -> Path:
    """A model directory and installed-package metadata (the plugin's entry point) for the engines."""
    base = Path(tempfile.mkdtemp(prefix="tq-gpu-"))
    (base / "model").mkdir()
    (base / "model" / "config.json").write_text(json.dumps(MODEL_CONFIG))
    dist = base / "site" / "turboquant_vllm-0.0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: turboquant-vllm\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\nturboquant = turboquant_vllm.vllm:register\n")
    return base


_done: dict[str, dict] = {}  # finished runs, for the script's summary


@lru_cache(maxsize=None)
def run(name: str) -> dict:
    spec = RUNS[name]
    base = workdir()
    env = dict(os.environ, **spec.get("env", {}))
    env["PYTHONPATH"] = os.pathsep.join([str(base / "site"), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    args = dict(model=str(base / "model"), lens=PROMPT_LENS, backend=spec.get("backend", "CUSTOM"), llm=spec["llm"])
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(ENGINE), json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=900)
    log = done.stdout + done.stderr
    (base / f"{name}.log").write_text(log)
    assert done.returncode == 0, f"{name} failed:\n{log[-6000:]}"
    kv = re.search(r"GPU KV cache size: ([\d,]+) tokens", log)
    assert kv, f"{name}: no KV cache size in the log"
    tokens = json.loads(next(line for line in log.splitlines() if line.startswith("RESULT "))[7:])
    startup = [line for line in log.splitlines() if "TurboQuant KV cache: preset" in line]
    jit = sorted(set(re.findall(r"JIT compilation during inference: (\w+)", log)))
    _done[name] = dict(kv_tokens=int(kv.group(1).replace(",", "")), tokens=tokens, startup=startup[:1], jit=jit)
    return _done[name]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb)]
    return sum(x == y for x, y in pairs) / len(pairs)


def test_kv_cache_is_3_7x_larger_in_tokens():
    flash, tq4 = run("flash"), run("tq4")
    assert tq4["kv_tokens"] / flash["kv_tokens"] >= 3.7, (tq4["kv_tokens"], flash["kv_tokens"])
    assert tq4["startup"] and "tq4" in tq4["startup"][0] and "3.76x" in tq4["startup"][0]


def test_kv_cache_follows_the_preset():
    tq3, tq4 = run("tq3"), run("tq4_eager")
    assert tq3["kv_tokens"] / tq4["kv_tokens"] >= 1.25  # 136 -> 104 B per token per head


def test_cuda_graphs_give_the_eager_tokens():
    graphs, eager = run("tq4")["tokens"], run("tq4_eager")["tokens"]
    assert [t[:8] for t in graphs] == [t[:8] for t in eager]
    assert agreement(graphs, eager) >= 0.9


def test_v2_runner_gives_the_v1_tokens():
    v2, v1 = run("tq4_v2")["tokens"], run("tq4")["tokens"]
    assert [t[:8] for t in v2] == [t[:8] for t in v1]
    assert agreement(v2, v1) >= 0.9


def test_chunked_prefill_gives_the_same_tokens():
    chunked, whole = run("tq4_chunked")["tokens"], run("tq4_eager")["tokens"]
    assert agreement(chunked, whole) >= 0.9


def test_no_kernel_of_ours_compiles_inside_a_request():
    for name in ("tq4", "tq4_eager", "tq4_chunked"):
        assert not [k for k in run(name)["jit"] if k in OUR_KERNELS], (name, run(name)["jit"])


if __name__ == "__main__":
    report = run_checks(module_checks(dict(globals())), sys.argv[1:])
    flash = _done.get("flash")
    summary = {
        name: {
            "kv_tokens": r["kv_tokens"],
            "startup": r["startup"],
            "jit_inside_requests": r["jit"],
            "agree_with_flash": round(agreement(r["tokens"], flash["tokens"]), 3) if flash else None,
        }
        for name, r in _done.items()
    }
    exit_with(report, runs=summary, logs=str(workdir()))
