"""The GPU check's own checks (test_gpu_openai_server.CHECKS) run on the CPU: the client side of every API check
against a stand-in server (fake_vllm: real HTTP, real SSE, the real `openai` client), failing where that server
misbehaves; and the bad-preset check against the real `vllm serve`, which refuses the preset before it needs a
device."""

from __future__ import annotations

import importlib.util

import pytest

from tests.serving import fake_vllm
from tests.serving import test_gpu_openai_server as srv

REFUSALS = ("bad_preset_fails_at_startup", "bad_calibration_fails_at_startup")  # `vllm serve` exiting at startup
API_CHECKS = [name for name in srv.CHECKS if name not in REFUSALS]


class FakeServer(srv.Server):
    """A stand-in server started in this process (fake_vllm on a free port); kill and stop shut it down."""

    httpd = None

    def start(self) -> FakeServer:
        self.httpd, self.port = fake_vllm.serve(self.model)
        self.startup_s = 0.0
        return self

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None

    kill = stop


@pytest.fixture
def fake_run(tmp_path, monkeypatch):
    """srv.RUN whose servers are stand-ins, the "tq" one up (and the fresh greedy round done)."""
    pytest.importorskip("openai")
    model = tmp_path / "model"
    fake_vllm.write_model_dir(model)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    run = srv.Run()
    run.model, run.log_dir = str(model), tmp_path / "logs"
    run.start_server = lambda name, backend, preset, extra=(): FakeServer(name, str(model), backend, preset,
                                                                          run.log_dir, extra).start()
    monkeypatch.setattr(srv, "RUN", run)
    run.server()
    yield run
    run.stop_all()


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


def test_the_new_server_checks_report_what_they_saw(fake_run):
    restart = srv.run_check("sigkill_restart_from_warm_cache")["details"]
    assert restart["identical"] == len(srv.PROMPTS) and restart["compiled_on_restart"] == []
    assert "tq" in fake_run.servers and fake_run.servers["tq"].name == "tq-restarted"
    presets = srv.run_check("every_preset_starts_and_answers")["details"]
    from turboquant_vllm.core.presets import PRESETS

    assert sorted(presets) == sorted(PRESETS) and all(len(d["texts"]) == 2 for d in presets.values())


def test_a_restart_that_compiles_fails_the_check(fake_run, tmp_path):
    real = FakeServer.start

    def compiling(self):
        (tmp_path / "triton" / f"kernel-of-{self.name}").mkdir(parents=True)
        return real(self)

    FakeServer.start = compiling
    try:
        record = srv.run_check("sigkill_restart_from_warm_cache")
    finally:
        FakeServer.start = real
    assert not record["passed"] and "kernel-of-tq-restarted" in record["details"]["error"]


def test_tokens_that_differ_without_graphs_fail_the_check(fake_run, monkeypatch):
    real = fake_vllm.sample
    monkeypatch.setattr(fake_vllm, "sample", lambda *a: [t + 1 for t in real(*a)])
    record = srv.run_check("no_cuda_graphs_matches_graphs")
    assert not record["passed"] and "identical" in record["details"]["error"]


def test_a_preset_that_does_not_start_fails_the_check(fake_run):
    real = fake_run.start_server

    def refusing(name, *a, **kw):
        if name == "preset-tq3":
            raise RuntimeError("preset-tq3: server exited with status 1 before /health answered")
        return real(name, *a, **kw)

    fake_run.start_server = refusing
    record = srv.run_check("every_preset_starts_and_answers")
    assert not record["passed"] and "preset-tq3" in record["details"]["error"]


@pytest.mark.parametrize("behaviour", ["refuses", "starts", "exits_silently"])
def test_the_bad_calibration_check_needs_an_exit_naming_the_file(tmp_path, monkeypatch, behaviour):
    """The check's own logic against stand-in commands: one that refuses as our settings do, one that keeps running
    (it started), one that exits without the message."""
    script = {"refuses": "import os, sys; sys.stderr.write('ValueError: key calibration file '"
                         " + os.environ['TURBOQUANT_KEY_CALIBRATION'] + ' does not exist; make one with "
                         "`turboquant-vllm calibrate`\\n'); sys.exit(1)",
              "starts": "import time; time.sleep(30)",
              "exits_silently": "import sys; sys.exit(1)"}[behaviour]
    monkeypatch.setattr(srv, "serve_command", lambda *a, **kw: [srv.sys.executable, "-c", script])
    monkeypatch.setattr(srv, "STARTUP_TIMEOUT_S", 3)
    run = srv.Run()
    run.model, run.log_dir = str(tmp_path / "model"), tmp_path / "logs"
    run.log_dir.mkdir(parents=True)
    monkeypatch.setattr(srv, "RUN", run)
    record = srv.run_check("bad_calibration_fails_at_startup")
    assert record["passed"] == (behaviour == "refuses"), record["details"]
