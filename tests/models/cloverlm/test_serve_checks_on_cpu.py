"""test_gpu_serve.py's own parts on the CPU: its API checks (the real `openai` client, real HTTP and server-sent
events) against the serving tests' stand-in server, failing where the chat template is not the served one; the
parsing of the offline command's output; the checkpoints it writes; the command it runs."""

from __future__ import annotations

import json
import sys

import pytest

from tests.models.cloverlm import test_gpu_serve as gs
from tests.serving import fake_vllm


@pytest.fixture
def fake(tmp_path):
    model = tmp_path / "model"
    fake_vllm.write_model_dir(model)
    httpd, port = fake_vllm.serve(str(model))
    yield f"http://127.0.0.1:{port}", model
    httpd.shutdown()
    httpd.server_close()


def test_the_api_checks_pass_against_a_well_behaved_server(fake):
    base_url, model = fake
    records = gs.api_records("api", base_url, str(model), model)
    assert [r["name"] for r in records] == ["api_models", "api_completion", "api_chat", "api_streaming"]
    assert all(r["passed"] for r in records), records
    streaming = records[-1]["details"]
    assert streaming["chunks"] > 1 and streaming["text"]


def test_the_api_checks_fail_on_the_wrong_model_or_chat_template(fake):
    base_url, model = fake
    wrong = gs.api_records("api", base_url, "other-model", model)
    assert not any(r["passed"] for r in wrong)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template="{{ messages[0]['content'] }}")))
    chat = {r["name"]: r for r in gs.api_records("api", base_url, str(model), model)}["api_chat"]
    assert not chat["passed"] and "AssertionError" in chat["details"]["error"]


def test_generations_are_parsed_from_the_offline_output():
    out = "prompt: A\ngenerated: one\ntwo\n\nprompt: B b\ngenerated:  x\n\n"
    assert gs.parse_generations(out) == [("A", "one\ntwo"), ("B b", " x")]
    assert gs.parse_generations("Traceback ...\n") == []
    run = dict(status=0, seconds=1.0, stderr="", generations=[(p, "text") for p in gs.PROMPTS])
    assert gs.offline_check(run)["generations"] == run["generations"]
    with pytest.raises(AssertionError):
        gs.offline_check(dict(run, generations=[(gs.PROMPTS[0], "text"), (gs.PROMPTS[1], " ")]))
    with pytest.raises(AssertionError):
        gs.offline_check(dict(run, status=1))


def test_the_checkpoints_and_the_command(tmp_path):
    from safetensors.torch import load_file

    dirs = gs.write_checkpoints(tmp_path)
    for d in dirs.values():
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
            p.name for p in d.iterdir()}
    assert (dirs["nvfp4"] / "hf_quant_config.json").is_file() and not (dirs["bf16"] / "hf_quant_config.json").exists()
    emb = load_file(str(dirs["bf16"] / "model.safetensors"))["transformer.emb.weight"].float()
    assert emb[0].abs().max() == 0 and emb[1:].std() > 0.1  # EOS (id 0) never greedy; logits of a few units
    cmd = gs.cli_command(dirs["bf16"], 2, "--api")
    assert cmd[:5] == [sys.executable, "-m", "turboquant_vllm.cli", "cloverlm", str(dirs["bf16"])]
    assert cmd[5:] == ["--tp", "2", "--max-model-len", "256", "--gpu-memory-utilization", "0.3", "--api"]
