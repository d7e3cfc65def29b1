"""GPU end to end: the OpenAI API of a real `vllm serve` on --attention-backend CUSTOM, through the real `openai` client
(skipped without CUDA, or without the converted SmolLM2-135M-Instruct directory).

    TURBOQUANT_SMOLLM2_DIR=DIR python -m pytest -m gpu tests/serving   # DIR: turboquant-vllm model smollm2 --out DIR

The server: `vllm serve MODEL --attention-backend CUSTOM --host 127.0.0.1 --port <free> --max-model-len 4096
--gpu-memory-utilization 0.3` ($TURBOQUANT_PRESET, default tq4), started once in its own process group, which is
killed whole at the end; a second one without --attention-backend (FLASH_ATTN, bf16 cache) for the greedy comparison.
The servers' logs: pytest's temporary folder (servers0/).

The tests, in order: /health, /metrics and /v1/models; completions and chat completions (the model's chat template:
the served prompt is the template's, and completing its tokens gives the chat answer); streaming (the chunks make the
non-streamed text); n > 1 with a seed; stop strings; max_tokens (finish_reason "length"); logprobs and top_logprobs
(finite, greedy picks the top one); seeded sampling reproduces; faults: 100 streams closed mid-stream (the server
serves on, vllm:kv_cache_usage_perc back to 0), prompts over max_model_len and malformed requests (4xx, never 5xx;
the server stays healthy); the fixed greedy prompt set (serving_common.PROMPTS) gives the fresh server's tokens again
after all that; agreement with FLASH_ATTN bf16 (first tokens: a floor); a second server without CUDA graphs
(cudagraph_mode NONE, the same compiled model) gives the fresh tokens exactly; every preset starts and answers;
SIGKILL to the whole server (no shutdown code runs), then the same command serves the fresh tokens again without
compiling a Triton kernel (the Triton cache gains no entry); TURBOQUANT_PRESET=bogus, and TURBOQUANT_KEY_CALIBRATION
naming a missing file or one that is no calibration, make `vllm serve` exit non-zero with our message (the valid
presets; the file and `turboquant-vllm calibrate`). Their client side runs on the CPU against a stand-in server
(test_openai_checks_on_cpu.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from benchmarks import serving_common as sc

pytestmark = pytest.mark.gpu

ABORTED_STREAMS = 100
# A floor against a broken cache (garbage agrees on ~no first token), not a quality bar: on SmolLM2-135M tq4's greedy
# text parts from bf16's within a few tokens (mean shared prefix 0.13 on an H100); quality is benchmarks.quality's.
AGREEMENT_FLOOR = 0.5  # fraction of prompts whose first greedy token equals FLASH_ATTN bf16's


class Run:
    """What the tests share: the model and preset, the servers (started on first use) and the fresh greedy round."""

    def __init__(self, model: str, preset: str, log_dir: Path, extra: tuple[str, ...] = ()):
        self.model, self.preset, self.log_dir, self.extra = model, preset, Path(log_dir), extra
        self.servers: dict[str, sc.Server] = {}
        self.failed: dict[str, str] = {}  # servers that did not start: not tried again (each try costs minutes)
        self.fresh: list[dict] | None = None  # the CUSTOM server's greedy outputs, first thing after its start

    def server(self, name: str = "tq") -> sc.Server:
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
                self.fresh = sc.greedy_outputs(self.servers[name], salt="fresh")
        return self.servers[name]

    def start_server(self, name: str, backend: str | None, preset: str | None,
                     extra: tuple[str, ...] = ()) -> sc.Server:
        """A started server of this run's model and serve arguments (+ extra), logs under log_dir/name."""
        return sc.Server(name, self.model, backend, preset, self.log_dir, self.extra + extra).start()

    def stop(self, name: str) -> None:
        server = self.servers.pop(name, None)
        if server is not None:
            server.stop()

    def stop_all(self) -> None:
        for name in list(self.servers):
            self.stop(name)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model = os.environ.get(sc.MODEL_ENV)
    why = sc.missing_model(model)
    if why:
        pytest.skip(why)
    servers = Run(model, os.environ.get(sc.PRESET_ENV) or "tq4", tmp_path_factory.mktemp("servers"))
    yield servers
    servers.stop_all()


def test_endpoints(run):
    s = run.server()
    health = sc.http_get(f"{s.base_url}/health")[0]
    models = [m.id for m in s.client().models.list().data]
    text = s.metrics()
    names = sorted({n for n, _, _ in sc.parse_metrics(text) if n.startswith("vllm:")})
    assert health == 200, health
    assert s.model in models, models
    assert names and "vllm:kv_cache_usage_perc" in names, names[:40]


def test_completion(run):
    s = run.server()
    r = s.client().completions.create(model=s.model, prompt=sc.COMPLETION_PROMPTS[0], max_tokens=16, temperature=0.0,
                                      extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert r.object == "text_completion" and r.model == s.model, (r.object, r.model)
    assert c.text and c.finish_reason in ("stop", "length"), (c.text, c.finish_reason)
    assert r.usage.completion_tokens == len(sc.extra(c, "token_ids")) and r.usage.prompt_tokens > 0, r.usage


def test_chat_template(run):
    """Chat completions render the model's chat template: the prompt's tokens are the template's text (rendered here
    from tokenizer_config.json) with its special tokens, and completing those tokens gives the chat answer's tokens."""
    s = run.server()
    client = s.client()
    messages = sc.PROMPTS[0]["messages"]
    chat = client.chat.completions.create(model=s.model, messages=messages, max_tokens=24, temperature=0.0,
                                          extra_body={"return_token_ids": True})
    prompt_ids = sc.extra(chat, "prompt_token_ids")
    answer_ids = sc.extra(chat.choices[0], "token_ids")
    assert prompt_ids and answer_ids, "no prompt_token_ids / token_ids in the chat answer"
    status, body = sc.post_raw(f"{s.base_url}/detokenize",
                               json.dumps({"model": s.model, "tokens": prompt_ids}).encode())
    assert status == 200, (status, body)
    served = json.loads(body)["prompt"]
    expected = sc.render_chat(s.model, messages)
    specials = sc.special_tokens(s.model)
    assert "<|im_start|>" in specials, sorted(specials)[:10]
    # /detokenize may or may not print special tokens: compare the text without them, and count them by id
    assert sc.without(served, specials) == sc.without(expected, specials), (served, expected)
    for token in ("<|im_start|>", "<|im_end|>"):
        assert list(prompt_ids).count(specials[token]) == expected.count(token), (token, prompt_ids)
    plain = client.completions.create(model=s.model, prompt=prompt_ids, max_tokens=24, temperature=0.0,
                                      extra_body={"return_token_ids": True})
    assert list(sc.extra(plain.choices[0], "token_ids")) == list(answer_ids)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content


def test_streaming(run):
    """Greedy streams: the chunks concatenated are the non-streamed text, and the usage the same."""
    s = run.server()
    client = s.client()
    for item in (sc.PROMPTS[1], sc.PROMPTS[-1]):
        kw = dict(max_tokens=40, temperature=0.0)
        whole = sc.generate(client, s.model, item, **kw)
        pieces, finish, usage = [], None, None
        for chunk in sc.generate(client, s.model, item, stream=True, stream_options={"include_usage": True}, **kw):
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                pieces.append((c.delta.content or "") if item["kind"] == "chat" else c.text)
                finish = c.finish_reason or finish
        streamed = "".join(pieces)
        expected = sc.choice_text(whole.choices[0])
        assert streamed == expected, (item["kind"], streamed, expected)
        assert finish == whole.choices[0].finish_reason, (finish, whole.choices[0].finish_reason)
        assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens, (usage, whole.usage)


def test_n_with_seed(run):
    """n = 4 samples with a seed: four choices, indexed 0..3, not all alike; the same request gives them again."""
    s = run.server()
    client = s.client()
    kw = dict(model=s.model, prompt=sc.COMPLETION_PROMPTS[1], n=4, seed=1234, temperature=0.8, max_tokens=24)
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert sorted(c.index for c in first.choices) == [0, 1, 2, 3], [c.index for c in first.choices]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)], "n > 1 with a seed differs"
    assert len(set(texts)) >= 2, texts
    chat = client.chat.completions.create(model=s.model, messages=sc.PROMPTS[1]["messages"], n=3, seed=7,
                                          temperature=0.8, max_tokens=16)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]


def test_stop_strings(run):
    """A word of a greedy answer as the stop string: the answer ends just before it, finish_reason "stop"."""
    s = run.server()
    client = s.client()
    for item in (sc.PROMPTS[2], sc.PROMPTS[9]):
        kw = dict(max_tokens=48, temperature=0.0, extra_body={"ignore_eos": True})
        text = sc.choice_text(sc.generate(client, s.model, item, **kw).choices[0])
        picked = sc.pick_stop(text)
        assert picked, f"no word to stop on in {text!r}"
        stop, expected = picked
        c = sc.generate(client, s.model, item, stop=[stop], **kw).choices[0]
        assert sc.choice_text(c) == expected and c.finish_reason == "stop", (stop, sc.choice_text(c), expected, c)


def test_max_tokens(run):
    s = run.server()
    client = s.client()
    for item, n in ((sc.PROMPTS[3], 5), (sc.PROMPTS[10], 7)):
        r = sc.generate(client, s.model, item, max_tokens=n, temperature=0.0,
                     extra_body={"ignore_eos": True, "return_token_ids": True})
        c = r.choices[0]
        assert c.finish_reason == "length", c.finish_reason
        assert r.usage.completion_tokens == n == len(sc.extra(c, "token_ids")), (r.usage, n)


def test_logprobs(run):
    """logprobs and top_logprobs: present, finite, <= 0, five alternatives a token; greedy picks the top one."""
    s = run.server()
    client = s.client()
    c = client.completions.create(model=s.model, prompt=sc.COMPLETION_PROMPTS[3], max_tokens=8, temperature=0.0,
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
    chat = client.chat.completions.create(model=s.model, messages=sc.PROMPTS[4]["messages"], max_tokens=8,
                                          temperature=0.0, logprobs=True, top_logprobs=5).choices[0]
    content = chat.logprobs.content
    assert content and all(math.isfinite(t.logprob) and len(t.top_logprobs) == 5 for t in content), content
    assert all(all(math.isfinite(a.logprob) for a in t.top_logprobs) for t in content)


def test_seed_reproducibility(run):
    """temperature 0.8 with a seed: the same text twice (completion and chat)."""
    s = run.server()
    client = s.client()
    for item in (sc.PROMPTS[5], sc.PROMPTS[12]):
        texts = [sc.choice_text(sc.generate(client, s.model, item, max_tokens=32, temperature=0.8,
                                            seed=seed).choices[0]) for seed in (42, 42)]
        assert texts[0] == texts[1], texts


def test_aborted_streams(run):
    """ABORTED_STREAMS long streams, each closed by its client after two chunks: the server serves on, and
    vllm:kv_cache_usage_perc (and the requests in flight) go back to 0."""
    s = run.server()
    client = s.client()
    prompt = " ".join(sc.COMPLETION_PROMPTS) * 6  # a few hundred tokens: blocks the usage gauge sees
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
        usage = sc.kv_cache_usage(text)
        if usage == 0 and sc.requests_in_flight(text) == 0:
            idle_s = round(time.monotonic() - closed_at, 1)
            break
        if not probed and time.monotonic() - closed_at > 15:  # a stale gauge: one step refreshes the stats
            sc.assert_still_serving(s)
            probed = True
        time.sleep(0.5)
    sc.assert_still_serving(s)
    after = s.metrics()
    details = dict(chunks_read=got, usage_during=sc.kv_cache_usage(during),
                   in_flight_during=sc.requests_in_flight(during),
                   usage_after=usage, back_to_zero_after_s=idle_s, needed_a_request_to_refresh=probed,
                   aborted_total=sum(sc.metric_values(after, "vllm:request_success_total", finished_reason="abort")))
    assert all(n >= 1 for n in got), got
    assert (details["usage_during"] or 0) > 0, details
    assert idle_s is not None, details


def test_too_long_prompt(run):
    """A prompt longer than the context is refused (4xx). One that fits but whose max_tokens would overrun the context
    is served to the context's last token (vLLM 0.33 lowers max_tokens to what is left): the cache's last slots."""
    s = run.server()
    client = s.client()
    long_text = "hello " * (sc.MAX_MODEL_LEN + 2000)
    statuses = {
        "completion": sc.status_of(lambda: client.completions.create(model=s.model, prompt=long_text, max_tokens=8)),
        "chat": sc.status_of(lambda: client.chat.completions.create(
            model=s.model, messages=[{"role": "user", "content": long_text}], max_tokens=8)),
    }
    assert all(sc.is_client_error(code) for code, _ in statuses.values()), statuses
    near_full = [200] * (sc.MAX_MODEL_LEN - 100)  # token ids: a length that no tokenizer changes
    out = client.completions.create(model=s.model, prompt=near_full, max_tokens=1000, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    used = out.usage.prompt_tokens + out.usage.completion_tokens
    assert used == sc.MAX_MODEL_LEN and out.choices[0].finish_reason == "length", (out.usage, out.choices[0])
    sc.assert_still_serving(s)


def test_malformed_requests(run):
    s = run.server()
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
    answers = {k: sc.post_raw(u, b if isinstance(b, bytes) else b.encode()) for k, (u, b) in bodies.items()}
    # * vLLM 0.25 (FLASH_ATTN alike) answers an unknown role with 200: the chat template renders it. Never a 5xx.
    assert all(sc.is_client_error(code) or (k == "bad_role" and code < 500)
               for k, (code, _) in answers.items()), answers
    sc.assert_still_serving(s)


def test_greedy_unchanged_after_the_checks(run):
    """PROMPTS' greedy tokens now equal those of the fresh server (another cache salt: a fresh prefill over blocks the
    checks above used); the same salt again (prefix-cache hits) shows in a failure's message, not asserted."""
    s = run.server()
    assert run.fresh, "no fresh greedy round (it failed at the server's start)"
    after = sc.greedy_outputs(s, salt="after")
    cached = sc.greedy_outputs(s, salt="fresh")
    fresh = [o["token_ids"] for o in run.fresh]
    same = sc.prefix_agreement([o["token_ids"] for o in after], fresh)
    hits = sc.prefix_agreement([o["token_ids"] for o in cached], fresh)
    details = dict(after=same, prefix_cache_hits=hits)
    assert same["identical"] == len(sc.PROMPTS), details


def test_agreement_with_flash_attn(run):
    """tq greedy tokens vs FLASH_ATTN bf16's, same prompts: the first tokens agree (a floor; the shared prefix shows in
    a failure's message)."""
    tq = run.server()
    fresh = run.fresh
    assert fresh, "no fresh greedy round (it failed at the server's start)"
    try:
        ref = sc.greedy_outputs(run.server("flash"), salt="fresh")
    finally:
        run.stop("flash")
    agree = sc.prefix_agreement([o["token_ids"] for o in fresh], [o["token_ids"] for o in ref])
    details = dict(preset=run.preset, **agree,
                   examples=[dict(kind=a["kind"], tq=a["text"], flash=b["text"]) for a, b in zip(fresh, ref)][::4],
                   tq_startup_s=tq.startup_s)
    assert agree["first_token_agrees"] >= AGREEMENT_FLOOR * agree["prompts"], details


def triton_cache_entries() -> set[str]:
    """The kernels in Triton's cache (TRITON_CACHE_DIR, else ~/.triton/cache): one folder each."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


def test_no_cuda_graphs_matches_graphs(run):
    """A second CUSTOM server, the same compiled model without CUDA graphs (cudagraph_mode NONE): PROMPTS' greedy
    tokens equal the graph-replaying server's fresh ones, prompt by prompt."""
    run.server()
    assert run.fresh, "no fresh greedy round (it failed at the server's start)"
    server = run.start_server("no-graphs", "CUSTOM", run.preset,
                              ("--compilation-config", json.dumps({"cudagraph_mode": "NONE"})))
    try:
        outs = sc.greedy_outputs(server, salt="fresh")
    finally:
        server.stop()
    agree = sc.prefix_agreement([o["token_ids"] for o in outs], [o["token_ids"] for o in run.fresh])
    details = dict(startup_s=server.startup_s, **agree)
    assert agree["identical"] == len(sc.PROMPTS), details


def test_every_preset_starts_and_answers(run):
    """Each preset's own server (one at a time, beside the running one) starts and answers a chat and a completion
    with tokens (their first tokens against the fresh round's show in a failure's message)."""
    from turboquant_vllm.core.presets import PRESETS

    run.server()
    items = [sc.PROMPTS[0], sc.PROMPTS[len(sc.CHAT_PROMPTS)]]
    fresh = [run.fresh[0], run.fresh[len(sc.CHAT_PROMPTS)]] if run.fresh else None
    details, failed = {}, {}
    for preset in PRESETS:
        try:
            server = run.start_server(f"preset-{preset}", "CUSTOM", preset)
        except Exception as exc:  # noqa: BLE001 - every preset is tried, the failures reported together
            failed[preset] = str(exc)[:1500]
            continue
        try:
            outs = sc.greedy_outputs(server, salt=preset, items=items)
        except Exception as exc:  # noqa: BLE001
            failed[preset] = f"{type(exc).__name__}: {str(exc)[:1500]}"
            continue
        finally:
            server.stop()
        agree = sc.prefix_agreement([o["token_ids"] for o in outs], [o["token_ids"] for o in fresh]) if fresh else {}
        details[preset] = dict(startup_s=server.startup_s, texts=[o["text"] for o in outs],
                               first_token_agrees=agree.get("first_token_agrees"))
    assert not failed, dict(failed=failed, answered=details)


def test_sigkill_restart_from_warm_cache(run):
    """SIGKILL to the CUSTOM server's whole process group, then the same command again: it starts, serves PROMPTS'
    fresh greedy tokens, and compiles no Triton kernel on the way (the Triton cache gains no entry)."""
    first = run.server()
    assert run.fresh, "no fresh greedy round (it failed at the server's start)"
    before = triton_cache_entries()
    first.kill()
    run.servers.pop("tq")
    server = run.servers["tq"] = run.start_server("tq-restarted", "CUSTOM", run.preset)
    outs = sc.greedy_outputs(server, salt="restarted")
    compiled = sorted(triton_cache_entries() - before)
    agree = sc.prefix_agreement([o["token_ids"] for o in outs], [o["token_ids"] for o in run.fresh])
    details = dict(killed_exit_status=first.exit_status, first_startup_s=first.startup_s,
                   restart_startup_s=server.startup_s, triton_cache_entries=len(before), compiled_on_restart=compiled,
                   **agree)
    assert agree["identical"] == len(sc.PROMPTS), details
    assert not compiled, details


def startup_refusal(run, name: str, env_vars: dict[str, str]) -> dict:
    """`vllm serve --attention-backend CUSTOM` with env_vars: its exit status (None: still running after the
    startup timeout, i.e. it started), seconds, and its whole log (stdout and stderr)."""
    stem = run.log_dir / name
    cmd = sc.serve_command(run.model, sc.free_port(), "CUSTOM", run.extra)
    env = sc.server_env(sc.plugin_site(run.log_dir), env_vars.get(sc.PRESET_ENV, run.preset))
    proc = sc.spawn(cmd, dict(env, **env_vars), stem)
    start = time.monotonic()
    try:
        status = proc.wait(timeout=sc.STARTUP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        status = None
    finally:
        sc.kill_group(proc, grace_s=5.0)  # its children too, whatever happened
    log = "".join(Path(f"{stem}{ext}").read_text(errors="replace") for ext in (".out", ".err"))
    return dict(exit_status=status, seconds=round(time.monotonic() - start, 1), log=log)


def test_bad_preset_fails_at_startup(run):
    """TURBOQUANT_PRESET=bogus: `vllm serve --attention-backend CUSTOM` exits non-zero; its log names the presets."""
    from turboquant_vllm.core.presets import PRESETS

    refusal = startup_refusal(run, "bogus", {sc.PRESET_ENV: "bogus"})
    log = refusal.pop("log")
    found = sc.preset_error_found(log, "bogus", list(PRESETS))
    details = dict(refusal, **found)
    assert details["exit_status"] not in (None, 0), details
    assert found["found"], dict(details, log_tail=log[-2000:])


def test_bad_calibration_fails_at_startup(run):
    """TURBOQUANT_KEY_CALIBRATION naming a missing file, then a file that is no calibration: `vllm serve` exits
    non-zero, its log naming the file and `turboquant-vllm calibrate`."""
    from turboquant_vllm.vllm.settings import CALIBRATION_ENV

    junk = run.log_dir / "not-a-calibration.safetensors"
    junk.write_bytes(b"not a safetensors file")
    details = {}
    for name, path in (("missing", run.log_dir / "no-such-calibration.safetensors"), ("junk", junk)):
        refusal = startup_refusal(run, f"calibration-{name}", {CALIBRATION_ENV: str(path)})
        log = refusal.pop("log")
        line = next((ln for ln in log.splitlines() if str(path) in ln and "turboquant-vllm calibrate" in ln), None)
        details[name] = dict(refusal, line=line)
        assert refusal["exit_status"] not in (None, 0) and line, dict(details, log_tail=log[-2000:])
