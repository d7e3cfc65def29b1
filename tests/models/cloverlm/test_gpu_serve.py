"""GPU end to end: `turboquant-vllm cloverlm` on small random CloverLM checkpoints (models.cloverlm.checkpoint, with
its test tokenizer), offline and over the OpenAI API, through the real `openai` client.

The checkpoints: bf16, and the NVFP4 variant (what CloverLM's converter writes; vLLM picks quartet2 from its
hf_quant_config.json). The embedding has std 0.2 (logits of a few units) and EOS's row is zero, so greedy text does
not end at once (a zero row gives EOS logit 0, far below the best of 511 others).

Runs, each a fresh vLLM (CUDA graphs on, max_model_len 256, GPU memory 0.3), its stdout / stderr in --logs:
  offline_bf16     `turboquant-vllm cloverlm BF16 --tp N --prompt ...`: exit 0, one non-empty generation a prompt
  offline_nvfp4    the NVFP4 checkpoint offline (--tp 1; with --tp > 1 the command must refuse it, exit 2)
  api_*            `... BF16 --tp N --api --port P`: /v1/models names the directory; a completion, a chat completion
                   (the checkpoint's chat template: completing the rendered template gives the same tokens) and a
                   stream (its chunks make the non-streamed greedy text), then SIGTERM stops the server before
                   the grace period ends (no SIGKILL needed) and the port is closed
  tq4_api_*        the same server and checks with --kv-preset tq4 (TurboQuant KV cache, attention backend CUSTOM)

    python -m pytest -q -m gpu tests/models/cloverlm/test_gpu_serve.py     # --tp 1, and --tp 2 on 2 GPUs

A failure names every failed check with its details. The API checks' client side runs on the CPU against a
stand-in server (test_serve_checks_on_cpu.py).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest

from benchmarks.serving_common import (HOST, assemble_report, check_record, free_port, http_get, kill_group,
                                       log_tail, plugin_site, render_chat, server_env, spawn, wait_healthy)

pytestmark = pytest.mark.gpu

MAX_MODEL_LEN = 256
GPU_MEMORY_UTILIZATION = 0.3
MAX_TOKENS = 16
PROMPTS = ("The capital of France is", "Write a short poem about the river")
STARTUP_TIMEOUT_S = 300
OFFLINE_TIMEOUT_S = 300
SHUTDOWN_GRACE_S = 30.0


# ---- checkpoints -------------------------------------------------------------------------------------------------

def write_checkpoints(base: Path) -> dict[str, Path]:
    """{"bf16": dir, "nvfp4": dir}: the same random weights, each with the test tokenizer."""
    import torch

    from turboquant_vllm.models.cloverlm import reference as ref
    from turboquant_vllm.models.cloverlm.checkpoint import (EOS, write_checkpoint, write_nvfp4_checkpoint,
                                                            write_tokenizer)

    shape = ref.CloverLMShape(vocab_size=512, num_blocks=2, heads=4, d_head=64, ratio=2, max_context=MAX_MODEL_LEN)
    dirs = {"bf16": base / "cloverlm-bf16", "nvfp4": base / "cloverlm-nvfp4"}
    for d in dirs.values():
        write_tokenizer(d, shape.vocab_size, MAX_MODEL_LEN)
    eos = json.loads((dirs["bf16"] / "tokenizer.json").read_text())["added_tokens"]
    eos_id = next(t["id"] for t in eos if t["content"] == EOS)
    w = ref.random_weights(shape, seed=0)
    emb = w["transformer.emb.weight"].float() * 10
    emb[eos_id] = 0
    w["transformer.emb.weight"] = emb.to(torch.bfloat16)
    write_checkpoint(shape, w, dirs["bf16"])
    write_nvfp4_checkpoint(shape, w, dirs["nvfp4"])
    return dirs


def cli_command(model_dir: Path, tp: int, *extra: str) -> list[str]:
    """`turboquant-vllm cloverlm` as this interpreter's module (the console script may be off PATH)."""
    return [sys.executable, "-m", "turboquant_vllm.cli", "cloverlm", str(model_dir), "--tp", str(tp),
            "--max-model-len", str(MAX_MODEL_LEN), "--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION), *extra]


def parse_generations(stdout: str) -> list[tuple[str, str]]:
    """(prompt, generation) pairs of the offline command's output ("prompt: P\\ngenerated: G\\n\\n" each)."""
    return re.findall(r"^prompt: (.*?)\ngenerated: (.*?)\n\n(?=prompt: |\Z)", stdout, re.DOTALL | re.MULTILINE)


# ---- offline -----------------------------------------------------------------------------------------------------

def run_offline(model_dir: Path, tp: int, env: dict, log_stem: Path, extra: tuple[str, ...] = ()) -> dict:
    """The offline command once: exit status, generations, seconds; its output in log_stem.{out,err}."""
    prompt_args = [a for p in PROMPTS for a in ("--prompt", p)]
    start = time.monotonic()
    proc = spawn(cli_command(model_dir, tp, *prompt_args, "--max-tokens", str(MAX_TOKENS), *extra), env, log_stem)
    try:
        status = proc.wait(timeout=OFFLINE_TIMEOUT_S)
    finally:
        kill_group(proc, grace_s=5.0)  # its engine processes too, whatever happened
    out = Path(f"{log_stem}.out").read_text(errors="replace")
    err = Path(f"{log_stem}.err").read_text(errors="replace")
    return dict(status=status, generations=parse_generations(out), seconds=round(time.monotonic() - start, 1),
                stderr=err, log=out + err)  # vLLM logs to stdout


def offline_check(run: dict) -> dict:
    details = dict(status=run["status"], seconds=run["seconds"], generations=run["generations"])
    assert run["status"] == 0, dict(details, stderr_tail=run["stderr"][-3000:])
    assert [p for p, _ in run["generations"]] == list(PROMPTS), details
    assert all(g.strip() for _, g in run["generations"]), details
    return details


# ---- the API (client side: CPU-tested against a stand-in server) -------------------------------------------------

def client_for(base_url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{base_url}/v1", api_key="x", timeout=120.0, max_retries=0)


def greedy(**extra_body) -> dict:
    """Greedy, never cut short by EOS, special tokens kept in the text (a random model may pick only those), and a
    cache salt of its own: each request prefills every prompt token (a prefix-cache hit computes the rest otherwise,
    which may turn a near-tie of a random model)."""
    return dict(max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True, "skip_special_tokens": False,
                                                                    "cache_salt": uuid.uuid4().hex, **extra_body})


def check_models(base_url: str, model: str, model_dir: Path) -> dict:
    ids = [m.id for m in client_for(base_url).models.list().data]
    assert ids == [model], ids
    return dict(models=ids)


def check_completion(base_url: str, model: str, model_dir: Path) -> dict:
    c = client_for(base_url).completions.create(model=model, prompt=PROMPTS[0], **greedy()).choices[0]
    assert c.text.strip() and c.finish_reason == "length", c
    return dict(prompt=PROMPTS[0], text=c.text)


def check_chat(base_url: str, model: str, model_dir: Path) -> dict:
    """The chat answer is the completion of the checkpoint's chat template rendered (tokenizer_config.json), token
    for token (a random model may pick tokens whose text is empty)."""
    client = client_for(base_url)
    messages = [{"role": "user", "content": PROMPTS[1]}]
    ids = {"return_tokens_as_token_ids": True}
    chat = client.chat.completions.create(model=model, messages=messages, logprobs=True, **greedy(**ids)).choices[0]
    rendered = render_chat(model_dir, messages)
    plain = client.completions.create(model=model, prompt=rendered, logprobs=0, **greedy(**ids)).choices[0]
    tokens, plain_tokens = [t.token for t in chat.logprobs.content], plain.logprobs.tokens
    answer = chat.message.content or ""
    assert len(tokens) == MAX_TOKENS and tokens == plain_tokens and answer == plain.text, dict(
        chat=answer, completion=plain.text, rendered=rendered, chat_tokens=tokens, completion_tokens=plain_tokens)
    return dict(rendered=rendered, answer=answer, tokens=tokens)


def check_streaming(base_url: str, model: str, model_dir: Path) -> dict:
    client = client_for(base_url)
    whole = client.completions.create(model=model, prompt=PROMPTS[0], **greedy()).choices[0].text
    chunks = [c.choices[0].text for c in client.completions.create(model=model, prompt=PROMPTS[0], stream=True,
                                                                   **greedy()) if c.choices]
    assert "".join(chunks).strip() and "".join(chunks) == whole, dict(chunks=chunks, whole=whole)
    return dict(chunks=len(chunks), text=whole)


API_CHECKS: dict[str, Callable[[str, str, Path], dict]] = {
    "models": check_models, "completion": check_completion, "chat": check_chat, "streaming": check_streaming}


def record(name: str, fn: Callable[[], dict]) -> dict:
    try:
        return check_record(name, True, fn())
    except Exception as exc:  # noqa: BLE001 - a report, not a test runner
        return check_record(name, False, dict(error=f"{type(exc).__name__}: {str(exc)[:3000]}"))


def api_records(prefix: str, base_url: str, model: str, model_dir: Path) -> list[dict]:
    return [record(f"{prefix}_{name}", lambda fn=fn: fn(base_url, model, model_dir)) for name, fn in API_CHECKS.items()]


# ---- the server --------------------------------------------------------------------------------------------------

def serve_and_check(prefix: str, model_dir: Path, tp: int, env: dict, log_dir: Path, extra: tuple[str, ...] = ()
                    ) -> list[dict]:
    """`cloverlm --api` on a free port: its start, the API checks, then SIGTERM and a clean exit."""
    port, stem = free_port(), log_dir / prefix
    base_url = f"http://{HOST}:{port}"
    proc = spawn(cli_command(model_dir, tp, "--api", "--port", str(port), *extra), env, stem)
    try:
        started = round(wait_healthy(base_url, proc, STARTUP_TIMEOUT_S), 1)
    except Exception as exc:  # noqa: BLE001 - reported, the server's log tail with it
        kill_group(proc, grace_s=5.0)
        return [check_record(f"{prefix}_start", False, dict(error=str(exc), log_tail=log_tail(stem)))]
    records = [check_record(f"{prefix}_start", True, dict(seconds=started, port=port))]
    records += api_records(prefix, base_url, str(model_dir), model_dir)
    start = time.monotonic()
    status = kill_group(proc, grace_s=SHUTDOWN_GRACE_S)
    seconds = round(time.monotonic() - start, 1)
    closed = http_get(f"{base_url}/health", timeout=2.0)[0] is None
    clean = status is not None and status != -9 and seconds < SHUTDOWN_GRACE_S and closed
    records.append(check_record(f"{prefix}_shutdown", clean, dict(exit_status=status, seconds=seconds,
                                                                  port_closed=closed)))
    return records


# ---- the whole run -----------------------------------------------------------------------------------------------

def run_all(tp: int, log_dir: Path) -> dict:
    import torch

    log_dir.mkdir(parents=True, exist_ok=True)
    begin = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="cloverlm-serve-"))
    dirs = write_checkpoints(work)
    # the package's entry point for vLLM's processes; one fresh compile cache, shared by the runs
    env = server_env(plugin_site(log_dir), None, dict(os.environ, VLLM_CACHE_ROOT=str(work / "vllm-cache")))
    records = [record("offline_bf16", lambda: offline_check(run_offline(dirs["bf16"], tp, env,
                                                                        log_dir / "offline_bf16")))]
    if tp == 1:
        def nvfp4() -> dict:
            run = run_offline(dirs["nvfp4"], 1, env, log_dir / "offline_nvfp4")
            details = offline_check(run)
            assert "weights from the NVFP4 checkpoint" in run["log"], "quartet2 did not read the NVFP4 weights"
            return details
    else:
        def nvfp4() -> dict:
            run = run_offline(dirs["nvfp4"], tp, env, log_dir / "offline_nvfp4")
            assert run["status"] == 2 and "do not split over GPUs" in run["stderr"], run["stderr"][-2000:]
            return dict(status=run["status"], refusal=run["stderr"].strip().splitlines()[-1])
    records.append(record("offline_nvfp4", nvfp4))
    records += serve_and_check("api", dirs["bf16"], tp, env, log_dir)
    records += serve_and_check("tq4_api", dirs["bf16"], tp, env, log_dir, ("--kv-preset", "tq4"))
    report = assemble_report(records, tp=tp, device=torch.cuda.get_device_name() if torch.cuda.is_available() else
                             None, logs=str(log_dir), seconds=round(time.monotonic() - begin, 1))
    report["summary"] = {r["name"]: "pass" if r["passed"] else "fail" for r in records}
    return report


@pytest.mark.parametrize("tp", [1, 2])
def test_cloverlm_serves_offline_and_over_the_api(tmp_path, tp):
    import torch

    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA GPU(s)")
    report = run_all(tp, tmp_path / "logs")
    failed = {r["name"]: r["details"] for r in report["checks"] if not r["passed"]}
    assert not failed, json.dumps(failed, indent=1, default=str)[:6000]
