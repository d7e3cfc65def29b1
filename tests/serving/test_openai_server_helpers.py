"""benchmarks.serving_common on the CPU, what the serving GPU tests and benchmarks share: ports, /metrics parsing,
agreement, stop strings, the chat template, the preset refusal's text, the server command and environment, process
groups, /health polling, the report, where the model and the text data are looked for."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import transformers

from benchmarks import serving_common as srv
from tests.serving import test_gpu_openai_server as api
from tests.serving.fake_vllm import CHATML  # the ChatML template SmolLM2 uses, in short
from turboquant_vllm.hf import smollm2

METRICS = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="/m/smol"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="/m/smol"} 0.5
vllm:num_requests_running{engine="0",model_name="/m/smol"} 3.0
vllm:num_requests_waiting{engine="0",model_name="/m/smol"} 2.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="/m/smol"} 20.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="/m/smol"} 7.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="/m/smol"} 27.0
weird_metric{path="a\\"b",other="x y"} NaN 1700000000000
python_gc_objects_collected_total{generation="0"} 1.234e+03
no_labels 4
this line is not a sample
"""


def test_free_port_is_bindable():
    import socket

    port = srv.free_port()
    assert 1024 <= port < 65536
    with socket.socket() as s:
        s.bind((srv.HOST, port))


def test_parse_metrics_reads_names_labels_and_values():
    samples = srv.parse_metrics(METRICS)
    assert len(samples) == 10  # comments and the stray line left out
    names = [n for n, _, _ in samples]
    assert names.count("vllm:kv_cache_usage_perc") == 2 and "no_labels" in names
    weird = next(s for s in samples if s[0] == "weird_metric")
    assert weird[1] == {"path": 'a"b', "other": "x y"} and weird[2] != weird[2]  # NaN, timestamp dropped
    assert srv.metric_values(METRICS, "no_labels") == [4.0]
    assert srv.metric_values(METRICS, "python_gc_objects_collected_total") == [1234.0]
    assert srv.metric_values(METRICS, "vllm:e2e_request_latency_seconds_bucket", le="+Inf") == [27.0]
    assert srv.metric_values(METRICS, "vllm:request_success_total", finished_reason="abort") == [20.0]
    assert sum(srv.metric_values(METRICS, "vllm:request_success_total")) == 27.0


def test_kv_cache_usage_and_requests_in_flight():
    assert srv.kv_cache_usage(METRICS) == 0.5  # the fullest engine
    assert srv.requests_in_flight(METRICS) == 5.0
    idle = 'vllm:kv_cache_usage_perc{engine="0"} 0.0\nvllm:num_requests_running{engine="0"} 0.0\n'
    assert srv.kv_cache_usage(idle) == 0.0 and srv.requests_in_flight(idle) == 0.0
    assert srv.kv_cache_usage("no_labels 1\n") is None


def test_shared_prefix_and_agreement():
    assert srv.shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert srv.shared_prefix([], [1]) == 0 and srv.shared_prefix([7, 8], [7, 8]) == 2
    agree = srv.prefix_agreement([[1, 2, 3, 4], [5, 6], [], [9]], [[1, 2, 0, 0], [5, 6], [], [8, 9]])
    assert agree["shared_prefix"] == [2, 2, 0, 0]
    assert agree["mean_shared_prefix_fraction"] == pytest.approx((0.5 + 1.0 + 1.0 + 0.0) / 4)
    assert agree["identical"] == 2 and agree["first_token_agrees"] == 2 and agree["prompts"] == 4
    assert agree["lengths"] == [[4, 4], [2, 2], [0, 0], [1, 2]]
    with pytest.raises(ValueError):
        srv.prefix_agreement([[1]], [])


def test_pick_stop_takes_the_first_late_word():
    assert srv.pick_stop("Paris is the capital of France.") == ("the", "Paris is ")
    assert srv.pick_stop("abc def abc") == ("def", "abc ")  # abc first occurs at 0: not a usable stop
    assert srv.pick_stop("  1, 2, 3, 4 ... 99") is None
    text = "\n    return fibonacci(n - 1) + fibonacci(n - 2)"
    stop, before = srv.pick_stop(text)
    assert text.startswith(before + stop) and stop not in before and len(before) >= 4


def test_the_prompt_set():
    assert len(srv.PROMPTS) == 16
    kinds = [p["kind"] for p in srv.PROMPTS]
    assert kinds.count("chat") == 8 and kinds.count("completion") == 8
    texts = [p["messages"][0]["content"] if p["kind"] == "chat" else p["prompt"] for p in srv.PROMPTS]
    assert len(set(texts)) == 16 and all(texts)
    assert all(p["messages"][0]["role"] == "user" for p in srv.PROMPTS if p["kind"] == "chat")


def model_dir(tmp_path: Path, template: str | None) -> Path:
    d = tmp_path / "model"
    d.mkdir(parents=True)
    config = {"bos_token": "<s>", "eos_token": "<|im_end|>"}
    if template is not None:
        config["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "tokenizer.json").write_text(json.dumps({"added_tokens": [
        {"id": 1, "content": "<|im_start|>", "special": True}, {"id": 2, "content": "<|im_end|>", "special": True},
        {"id": 9, "content": "word", "special": False}]}))
    return d


def test_render_chat_uses_the_model_template(tmp_path):
    d = model_dir(tmp_path, CHATML)
    text = srv.render_chat(d, [{"role": "user", "content": "Hi there"}])
    assert text == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    specials = srv.special_tokens(d)
    assert specials == {"<|im_start|>": 1, "<|im_end|>": 2}
    assert srv.without(text, specials) == "user\nHi there\nassistant\n"
    with pytest.raises(ValueError, match="no chat_template"):
        srv.render_chat(model_dir(tmp_path / "other", None), [{"role": "user", "content": "x"}])


@pytest.mark.skipif(not (smollm2.default_model_dir() / "tokenizer_config.json").is_file(),
                    reason=f"no converted SmolLM2-135M-Instruct in {smollm2.default_model_dir()}: "
                           f"`turboquant-vllm model smollm2` writes it there")
def test_render_chat_matches_transformers_on_smollm2():
    d = smollm2.default_model_dir()
    tok = transformers.AutoTokenizer.from_pretrained(d)
    for p in srv.PROMPTS[:8]:
        assert srv.render_chat(d, p["messages"]) == tok.apply_chat_template(p["messages"], tokenize=False,
                                                                            add_generation_prompt=True)


def test_preset_error_found_matches_our_message():
    """The refusal the settings pass on from core.presets (`vllm serve` prints it behind its source, e.g.
    "TURBOQUANT_PRESET: "); the whole path runs in test_openai_checks_on_cpu's bad-preset test."""
    from turboquant_vllm.core.presets import PRESETS, get_preset

    with pytest.raises(ValueError) as refused:
        get_preset("bogus")
    stderr = f"Traceback (most recent call last):\n  ...\nValueError: {srv.PRESET_ENV}: {refused.value}\n"
    found = srv.preset_error_found(stderr, "bogus", list(PRESETS))
    assert found["found"] and found["missing_presets"] == [] and "bogus" in found["line"]
    assert not srv.preset_error_found("ValueError: something else\n", "bogus", list(PRESETS))["found"]
    partial = srv.preset_error_found("unknown TurboQuant preset 'bogus'; choose one of tq4\n", "bogus", ["tq4", "tq3"])
    assert not partial["found"] and partial["missing_presets"] == ["tq3"]


def test_serve_command():
    cmd = srv.serve_command("/m/smol", 8123, extra=("--enforce-eager",))
    assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "/m/smol"]
    joined = " ".join(cmd)
    for part in ("--host 127.0.0.1", "--port 8123", "--max-model-len 4096", "--gpu-memory-utilization 0.3",
                 "--attention-backend CUSTOM"):
        assert part in joined
    assert cmd[-1] == "--enforce-eager"
    assert "--attention-backend" not in srv.serve_command("/m/smol", 8123, backend=None)


def test_server_env_and_plugin_site(tmp_path):
    site = srv.plugin_site(tmp_path)
    env = srv.server_env(site, "tq3", base={"PYTHONPATH": "/elsewhere", srv.PRESET_ENV: "tq4", "KEEP": "1"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(site), str(srv.ROOT / "src"), "/elsewhere"]
    assert env[srv.PRESET_ENV] == "tq3" and env["KEEP"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert srv.PRESET_ENV not in srv.server_env(site, None, base={srv.PRESET_ENV: "tq4"})
    (dist,) = metadata.distributions(path=[str(site)])
    (ep,) = [e for e in dist.entry_points if e.group == "vllm.general_plugins"]
    pyproject = tomllib.loads((srv.ROOT / "pyproject.toml").read_text())
    assert ep.value == pyproject["project"]["entry-points"]["vllm.general_plugins"]["turboquant"]
    assert dist.metadata["Name"] == "turboquant-vllm"


def test_report_assembly():
    records = [srv.check_record("a", True, {"x": 1}), srv.check_record("b", 0, {"error": "boom"})]
    assert records[1] == {"name": "b", "passed": False, "details": {"error": "boom"}}
    report = srv.assemble_report(records, preset="tq4")
    assert report["passed"] == 1 and report["failed"] == 1 and report["all_passed"] is False
    assert report["preset"] == "tq4" and report["checks"] == records
    assert srv.assemble_report([srv.check_record("a", True, {})])["all_passed"] is True
    assert srv.assemble_report([])["all_passed"] is False  # no check run is no pass


def test_a_server_that_did_not_start_is_not_tried_again(monkeypatch, tmp_path):
    tries = []

    def start(self):
        tries.append(self.name)
        raise RuntimeError("tq: server exited with status 1 before /health answered")

    monkeypatch.setattr(srv.Server, "start", start)
    run = api.Run("/m", "tq4", tmp_path)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="exited with status 1"):
            run.server()
    assert tries == ["tq"] and run.servers == {} and run.fresh is None


def test_missing_model_says_how_to_make_one(tmp_path):
    assert srv.MODEL_ENV in srv.missing_model(None) and "turboquant-vllm model smollm2" in srv.missing_model("")
    assert "no config.json" in srv.missing_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert srv.missing_model(str(tmp_path)) is None


def test_text_data_is_looked_for_where_the_skip_reason_says(tmp_path, monkeypatch):
    monkeypatch.setenv(srv.TEXT_DATA_ENV, str(tmp_path / "nowhere"))
    assert srv.text_data_candidates() == [tmp_path / "nowhere"] and srv.text_data_dir() is None
    why = srv.missing_text_data()
    for needle in (str(tmp_path / "nowhere"), "wikitext2-test.txt", "paul_graham_essays", "gutenberg",
                   "../shared/data", srv.TEXT_DATA_ENV):
        assert needle in why, (needle, why)
    monkeypatch.setenv(srv.TEXT_DATA_ENV, str(tmp_path))
    assert srv.text_data_dir() == tmp_path and srv.missing_text_data() is None
    monkeypatch.delenv(srv.TEXT_DATA_ENV)
    assert srv.text_data_candidates(tmp_path / "repo") == [tmp_path / "repo" / ".gpukit" / "w2" / "data",
                                                          tmp_path / "shared" / "data"]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie is dead, only not yet reaped


def test_kill_group_ends_the_process_and_its_children(tmp_path):
    pidfile = tmp_path / "child.pid"
    # the child ignores SIGTERM (as an engine core may outlive its API server); its parent dies of it
    cmd = ["bash", "-c", f"(trap '' TERM; exec sleep 300) & echo $! > {pidfile}; wait"]
    proc = srv.spawn(cmd, dict(os.environ), tmp_path / "logs" / "group")
    for _ in range(100):
        if pidfile.exists() and pidfile.read_text().strip():
            break
        time.sleep(0.05)
    child = int(pidfile.read_text())
    assert os.getpgid(child) == proc.pid  # one group, led by proc
    start = time.monotonic()
    status = srv.kill_group(proc, grace_s=1.0)
    assert status == -15 and time.monotonic() - start < 15
    time.sleep(0.2)
    assert not alive(proc.pid) and not alive(child)
    assert (tmp_path / "logs" / "group.out").exists() and (tmp_path / "logs" / "group.err").exists()
    assert srv.kill_group(proc) == status  # a group already gone: no error


class Health(http.server.BaseHTTPRequestHandler):
    calls = 0
    ready_after = 2

    def do_GET(self):  # noqa: N802 - http.server's name
        type(self).calls += 1
        code = 200 if self.path == "/health" and type(self).calls > self.ready_after else 503
        if self.path not in ("/health",):
            code = 404
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b"{}")

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        try:
            json.loads(body)
            code = 200
        except ValueError:
            code = 400
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b'{"error": "bad json"}' if code == 400 else b'{"ok": true}')

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    Health.calls = 0
    server = http.server.ThreadingHTTPServer((srv.HOST, 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://{srv.HOST}:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_wait_healthy_polls_until_200(health_server):
    proc = subprocess.Popen(["sleep", "30"])
    try:
        seconds = srv.wait_healthy(health_server, proc, timeout_s=10, poll_s=0.05)
        assert 0 <= seconds < 10 and Health.calls == 3
    finally:
        proc.kill()
        proc.wait()
    assert srv.http_get(f"{health_server}/metrics")[0] == 404
    assert srv.post_raw(f"{health_server}/v1/completions", b'{"model": ')[0] == 400
    assert srv.post_raw(f"{health_server}/v1/completions", b'{"model": "m"}') == (200, '{"ok": true}')


def test_wait_healthy_stops_when_the_server_dies_or_time_is_up(health_server):
    dead = subprocess.Popen(["true"])
    dead.wait()
    port = srv.free_port()  # nothing listens there
    assert srv.http_get(f"http://{srv.HOST}:{port}/health", timeout=1)[0] is None
    with pytest.raises(RuntimeError, match="exited with status 0"):
        srv.wait_healthy(f"http://{srv.HOST}:{port}", dead, timeout_s=10, poll_s=0.05)
    Health.ready_after = 10**9
    proc = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(TimeoutError):
            srv.wait_healthy(health_server, proc, timeout_s=0.3, poll_s=0.05)
    finally:
        Health.ready_after = 2
        proc.kill()
        proc.wait()
