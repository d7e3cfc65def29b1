"""The OpenAI API GPU tests (test_gpu_openai_server) run on the CPU: the client side of every API test against a
stand-in server (fake_vllm: real HTTP, real SSE, the real `openai` client), failing where that server misbehaves; and
the bad-preset test against the real `vllm serve`, which refuses the preset before it needs a device."""

from __future__ import annotations

import pytest

from benchmarks import serving_common as sc
from tests.serving import fake_vllm
from tests.serving import test_gpu_openai_server as api
from turboquant_vllm.core.presets import PRESETS

REFUSALS = ("test_bad_preset_fails_at_startup", "test_bad_calibration_fails_at_startup")  # `vllm serve` exiting
API_TESTS = [name for name in dir(api) if name.startswith("test_") and name not in REFUSALS]


class FakeServer(sc.Server):
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
    """api.Run whose servers are stand-ins, the "tq" one up (and the fresh greedy round done); the names of the
    servers it started in fake_run.started."""
    model = tmp_path / "model"
    fake_vllm.write_model_dir(model)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    run = api.Run(str(model), "tq4", tmp_path / "logs")
    run.started = []

    def start_server(name, backend, preset, extra=()):
        run.started.append(name)
        return FakeServer(name, str(model), backend, preset, run.log_dir, extra).start()

    run.start_server = start_server
    run.server()
    yield run
    run.stop_all()


@pytest.mark.parametrize("name", API_TESTS)
def test_api_test_passes_against_a_well_behaved_server(fake_run, name):
    getattr(api, name)(fake_run)


def test_the_tests_leave_what_they_say(fake_run):
    api.test_aborted_streams(fake_run)
    metrics = fake_run.server().metrics()
    assert sc.counter(metrics, "vllm:request_success_total", finished_reason="abort") == api.ABORTED_STREAMS
    assert sc.kv_cache_usage(metrics) == 0 and sc.requests_in_flight(metrics) == 0
    api.test_agreement_with_flash_attn(fake_run)
    assert "flash" in fake_run.started and "flash" not in fake_run.servers  # stopped after its round
    api.test_sigkill_restart_from_warm_cache(fake_run)
    assert fake_run.servers["tq"].name == "tq-restarted"
    api.test_every_preset_starts_and_answers(fake_run)
    assert [n for n in fake_run.started if n.startswith("preset-")] == [f"preset-{p}" for p in PRESETS]


def test_a_server_answering_500_to_bad_json_fails_the_test(fake_run, monkeypatch):
    real = fake_vllm.Handler.reply

    def reply(self, status, doc, content_type="application/json"):
        real(self, 500 if status == 400 else status, doc, content_type)

    monkeypatch.setattr(fake_vllm.Handler, "reply", reply)
    with pytest.raises(AssertionError, match="500"):
        api.test_malformed_requests(fake_run)


def test_greedy_tokens_that_drift_fail_the_test(fake_run, monkeypatch):
    real = fake_vllm.sample

    def drifting(prompt_ids, max_tokens, temperature, seed, index):
        ids = real(prompt_ids, max_tokens, temperature, seed, index)
        return ids[:-1] + [ids[-1] + 1]  # the last token differs from the fresh round's

    monkeypatch.setattr(fake_vllm, "sample", drifting)
    with pytest.raises(AssertionError, match="identical"):
        api.test_greedy_unchanged_after_the_checks(fake_run)


def test_stop_strings_not_honoured_fail_the_test(fake_run, monkeypatch):
    real = fake_vllm.choices_for

    def ignoring_stop(state, body, chat):
        return real(state, dict(body, stop=None), chat)

    monkeypatch.setattr(fake_vllm, "choices_for", ignoring_stop)
    with pytest.raises(AssertionError):
        api.test_stop_strings(fake_run)


@pytest.mark.slow  # a real `vllm serve` start: ~11 s (CI's slow tier)
def test_bad_preset_test_against_the_real_vllm_serve(tmp_path):
    """`vllm serve` loads the plugins, hence refuses the preset, before it looks for a device: this runs here."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    run = api.Run(str(model), "tq4", tmp_path / "logs")
    api.test_bad_preset_fails_at_startup(run)
    log = (tmp_path / "logs" / "bogus.err").read_text() + (tmp_path / "logs" / "bogus.out").read_text()
    assert "unknown TurboQuant preset 'bogus'" in log


def test_a_restart_that_compiles_fails_the_test(fake_run, tmp_path, monkeypatch):
    real = FakeServer.start

    def compiling(self):
        (tmp_path / "triton" / f"kernel-of-{self.name}").mkdir(parents=True)
        return real(self)

    monkeypatch.setattr(FakeServer, "start", compiling)
    with pytest.raises(AssertionError, match="kernel-of-tq-restarted"):
        api.test_sigkill_restart_from_warm_cache(fake_run)


def test_tokens_that_differ_without_graphs_fail_the_test(fake_run, monkeypatch):
    real = fake_vllm.sample
    monkeypatch.setattr(fake_vllm, "sample", lambda *a: [t + 1 for t in real(*a)])
    with pytest.raises(AssertionError, match="identical"):
        api.test_no_cuda_graphs_matches_graphs(fake_run)


def test_a_preset_that_does_not_start_fails_the_test(fake_run):
    real = fake_run.start_server

    def refusing(name, *a, **kw):
        if name == "preset-tq3":
            raise RuntimeError("preset-tq3: server exited with status 1 before /health answered")
        return real(name, *a, **kw)

    fake_run.start_server = refusing
    with pytest.raises(AssertionError, match="preset-tq3"):
        api.test_every_preset_starts_and_answers(fake_run)


@pytest.mark.parametrize("behaviour", ["refuses", "starts", "exits_silently"])
def test_the_bad_calibration_test_needs_an_exit_naming_the_file(tmp_path, monkeypatch, behaviour):
    """The test's own logic against stand-in commands: one that refuses as our settings do, one that keeps running
    (it started), one that exits without the message."""
    script = {"refuses": "import os, sys; sys.stderr.write('ValueError: key calibration file '"
                         " + os.environ['TURBOQUANT_KEY_CALIBRATION'] + ' does not exist; make one with "
                         "`turboquant-vllm calibrate`\\n'); sys.exit(1)",
              "starts": "import time; time.sleep(30)",
              "exits_silently": "import sys; sys.exit(1)"}[behaviour]
    monkeypatch.setattr(sc, "serve_command", lambda *a, **kw: [sc.sys.executable, "-c", script])
    monkeypatch.setattr(sc, "STARTUP_TIMEOUT_S", 3)
    run = api.Run(str(tmp_path / "model"), "tq4", tmp_path / "logs")
    run.log_dir.mkdir(parents=True)
    if behaviour == "refuses":
        api.test_bad_calibration_fails_at_startup(run)
    else:
        with pytest.raises(AssertionError):
            api.test_bad_calibration_fails_at_startup(run)
