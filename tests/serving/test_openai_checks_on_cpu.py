"""The GPU check's own checks (test_gpu_openai_server.CHECKS) run on the CPU: the client side of every API check
against a stand-in server (fake_vllm: real HTTP, real SSE, the real `openai` client), failing where that server
misbehaves; and the bad-preset check against the real `vllm serve`, which refuses the preset before it needs a
device."""

from __future__ import annotations

import importlib.util

import pytest

from tests.serving import fake_vllm
from tests.serving import test_gpu_openai_server as srv

API_CHECKS = [name for name in srv.CHECKS if name != "bad_preset_fails_at_startup"]


@pytest.fixture
def fake_run(tmp_path, monkeypatch):
    """srv.RUN with a fake "tq" and "flash" server already up (and the fresh greedy round done)."""
    pytest.importorskip("openai")
    model = tmp_path / "model"
    fake_vllm.write_model_dir(model)
    run = srv.Run()
    run.model, run.log_dir = str(model), tmp_path / "logs"
    httpds = []
    for name in ("tq", "flash"):
        httpd, port = fake_vllm.serve(str(model))
        server = srv.Server(name, str(model), None, None, run.log_dir)
        server.port = port
        run.servers[name] = server
        httpds.append(httpd)
    monkeypatch.setattr(srv, "RUN", run)
    run.fresh = srv.greedy_outputs(run.servers["tq"], salt="fresh")
    yield run
    for httpd in httpds:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("name", API_CHECKS)
def test_api_check_passes_against_a_well_behaved_server(fake_run, name):
    record = srv.run_check(name)
    assert record["passed"], record["details"]
    json_safe = srv.assemble_report([record])
    assert json_safe["all_passed"]


def test_the_checks_report_what_they_saw(fake_run):
    aborted = srv.run_check("aborted_streams")["details"]
    assert aborted["usage_during"] > 0 and aborted["usage_after"] == 0 and aborted["back_to_zero_after_s"] < 15
    assert aborted["aborted_total"] == srv.ABORTED_STREAMS and all(n >= 2 for n in aborted["chunks_read"])
    agree = srv.run_check("agreement_with_flash_attn")["details"]
    assert agree["identical"] == len(srv.PROMPTS) and agree["mean_shared_prefix_fraction"] == 1.0
    assert "flash" not in fake_run.servers  # stopped after its round
    malformed = srv.run_check("malformed_requests")["details"]
    assert malformed["unknown_model"]["status"] == 404 and malformed["invalid_json"]["status"] == 400


def test_a_server_answering_500_to_bad_json_fails_the_check(fake_run, monkeypatch):
    real = fake_vllm.Handler.reply

    def reply(self, status, doc, content_type="application/json"):
        real(self, 500 if status == 400 else status, doc, content_type)

    monkeypatch.setattr(fake_vllm.Handler, "reply", reply)
    record = srv.run_check("malformed_requests")
    assert not record["passed"] and "500" in record["details"]["error"]


def test_greedy_tokens_that_drift_fail_the_check(fake_run, monkeypatch):
    real = fake_vllm.sample

    def drifting(prompt_ids, max_tokens, temperature, seed, index):
        ids = real(prompt_ids, max_tokens, temperature, seed, index)
        return ids[:-1] + [ids[-1] + 1]  # the last token differs from the fresh round's

    monkeypatch.setattr(fake_vllm, "sample", drifting)
    record = srv.run_check("greedy_unchanged_after_the_checks")
    assert not record["passed"] and "identical" in record["details"]["error"]


def test_stop_strings_not_honoured_fail_the_check(fake_run, monkeypatch):
    real = fake_vllm.choices_for

    def ignoring_stop(state, body, chat):
        return real(state, dict(body, stop=None), chat)

    monkeypatch.setattr(fake_vllm, "choices_for", ignoring_stop)
    assert not srv.run_check("stop_strings")["passed"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM installed")
def test_bad_preset_check_against_the_real_vllm_serve(tmp_path, monkeypatch):
    """`vllm serve` loads the plugins, hence refuses the preset, before it looks for a device: this runs here."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    run = srv.Run()
    run.model, run.log_dir = str(model), tmp_path / "logs"
    monkeypatch.setattr(srv, "RUN", run)
    record = srv.run_check("bad_preset_fails_at_startup")
    assert record["passed"], record["details"]
    assert record["details"]["exit_status"] != 0 and "'bogus'" in record["details"]["line"]
