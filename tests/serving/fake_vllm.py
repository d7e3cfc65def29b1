"""A stand-in for `vllm serve`'s OpenAI API on the CPU, to run the GPU check's client side against (the real `openai`
client, real HTTP, real server-sent events): only its shapes and rules are vLLM's, not its model.

One character is one token (id 100 + its code point), the chat template's special tokens are ids 1 and 2. The "model"
writes words drawn from a generator seeded by the prompt's tokens (greedy), plus the request's seed and the choice's
index when sampling (no seed: fresh randomness). It honours max_tokens, stop strings, n, logprobs / top_logprobs,
return_token_ids, streaming with include_usage, and answers 4xx to what vLLM refuses: prompts of MAX_MODEL_LEN tokens or more,
malformed JSON or fields, an unknown model. /metrics counts the streams in flight (a closed client ends its stream),
the finished and aborted ones, and "preemptions": a stream that starts while the streams in flight hold more than
kv_tokens tokens (prompt and answer tokens each; serve(..., kv_tokens=N)) counts one, as a KV cache of N tokens
would preempt. write_tokenizer gives the model folder a real (character-level) Hugging Face tokenizer, for clients
that load one (`vllm bench serve`).
"""

from __future__ import annotations

import http.server
import json
import random
import threading
import time
import zlib

MAX_MODEL_LEN = 4096
SPECIALS = {"<|im_start|>": 1, "<|im_end|>": 2}
WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "light", "Paris", "seven", "the", "of", "sea", "blue")
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_model_dir(path) -> None:
    """The tokenizer files the checks read from the model folder (the chat template, the special tokens)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    (path / "tokenizer.json").write_text(json.dumps(
        {"added_tokens": [{"id": i, "content": t, "special": True} for t, i in SPECIALS.items()]}))


def write_tokenizer(path) -> None:
    """write_model_dir's folder with a tokenizer transformers loads: one token a character (the printable ASCII ones;
    others are [UNK]), the chat template's special tokens as ids 1 and 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    write_model_dir(path)
    vocab = {"[UNK]": 0, **SPECIALS}
    for code in range(32, 127):
        vocab.setdefault(chr(code), len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>", "unk_token": "[UNK]",
         "tokenizer_class": "PreTrainedTokenizerFast"}))


def tokenize(text: str) -> list[int]:
    ids, i = [], 0
    while i < len(text):
        special = next((t for t in SPECIALS if text.startswith(t, i)), None)
        if special:
            ids.append(SPECIALS[special])
            i += len(special)
        else:
            ids.append(100 + ord(text[i]))
            i += 1
    return ids


def detokenize(ids: list[int]) -> str:
    names = {i: t for t, i in SPECIALS.items()}
    return "".join(names.get(i) or chr(i - 100) for i in ids)


def render(messages: list[dict]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


class Invalid(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class State:
    def __init__(self, model: str, kv_tokens: int | None = None):
        self.model = model
        self.kv_tokens = kv_tokens
        self.lock = threading.Lock()
        self.running = 0
        self.aborted = 0
        self.finished = 0
        self.tokens_in_flight = 0
        self.preemptions = 0

    def admit(self, tokens: int) -> None:
        """A stream of `tokens` (prompt and answer) starts: past the KV budget, that is a preemption."""
        with self.lock:
            self.running += 1
            self.tokens_in_flight += tokens
            if self.kv_tokens is not None and self.tokens_in_flight > self.kv_tokens:
                self.preemptions += 1

    def release(self, tokens: int, aborted: bool) -> None:
        with self.lock:
            self.running -= 1
            self.tokens_in_flight -= tokens
            if aborted:
                self.aborted += 1
            else:
                self.finished += 1

    def metrics(self) -> str:
        labels = f'engine="0",model_name="{self.model}"'
        return (f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{labels}}} {self.running * 0.01}\n"
                f"vllm:num_requests_running{{{labels}}} {float(self.running)}\n"
                f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
                f"# TYPE vllm:num_preemptions_total counter\n"
                f"vllm:num_preemptions_total{{{labels}}} {float(self.preemptions)}\n"
                f'vllm:request_success_total{{{labels},finished_reason="abort"}} {float(self.aborted)}\n'
                f'vllm:request_success_total{{{labels},finished_reason="length"}} {float(self.finished)}\n')


def sample(prompt_ids: list[int], max_tokens: int, temperature: float, seed: int | None, index: int) -> list[int]:
    key = zlib.crc32(bytes(str(prompt_ids), "ascii"))
    if temperature > 0:
        rng = random.Random(key + 7919 * (seed + index)) if seed is not None else random.Random()
    else:
        rng = random.Random(key)
    text = ""
    while len(text) < max_tokens:
        text += " " + rng.choice(WORDS)
    return tokenize(text[:max_tokens])


def check_number(body: dict, name: str, default, lo=None, integer=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise Invalid(400, f"{name}: not a number")
    if lo is not None and value < lo:
        raise Invalid(400, f"{name}: must be >= {lo}")
    return value


def choices_for(state: State, body: dict, chat: bool) -> tuple[list[int], list[dict]]:
    """The prompt's tokens and each choice's tokens, text and finish reason; Invalid for what vLLM refuses."""
    if body.get("model") != state.model:
        raise Invalid(404, f"The model `{body.get('model')}` does not exist.")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and "content" in m
                for m in messages):
            raise Invalid(400, "messages: a list of {role, content}")
        prompt_ids = tokenize(render(messages))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt_ids = tokenize(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = prompt
        else:
            raise Invalid(400, "prompt: a string or a list of token ids")
    max_tokens = check_number(body, "max_completion_tokens" if chat and "max_completion_tokens" in body else
                              "max_tokens", 16, lo=1, integer=True)
    temperature = check_number(body, "temperature", 1.0, lo=0.0)
    n = check_number(body, "n", 1, lo=1, integer=True)
    seed = check_number(body, "seed", None, integer=True)
    if len(prompt_ids) >= MAX_MODEL_LEN:
        raise Invalid(400, f"This model's maximum context length is {MAX_MODEL_LEN} tokens")
    max_tokens = min(max_tokens, MAX_MODEL_LEN - len(prompt_ids))  # as vLLM 0.33: what the context has left
    stops = body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    out = []
    for index in range(n):
        ids = sample(prompt_ids, max_tokens, temperature, seed, index)
        text, finish = detokenize(ids), "length"
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            text, finish = text[:min(hits)], "stop"
            ids = tokenize(text)
        out.append(dict(index=index, ids=ids, text=text, finish=finish))
    return prompt_ids, out


def logprobs_of(ids: list[int], top: int, chat: bool):
    entries = []
    for i in ids:
        alternatives = [(detokenize([i]), -0.1)] + [(f"<{k}>", -1.0 - k) for k in range(1, top)]
        entries.append((detokenize([i]), -0.1, alternatives))
    if chat:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": [{"token": a, "logprob": b, "bytes": list(a.encode())} for a, b in alts]}
                            for t, lp, alts in entries]}
    return {"tokens": [t for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [dict(alts) for _, _, alts in entries], "text_offset": list(range(len(entries)))}


class Handler(http.server.BaseHTTPRequestHandler):
    state: State
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, status: int, doc, content_type: str = "application/json") -> None:
        body = doc.encode() if isinstance(doc, str) else json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/health":
            self.reply(200, "")
        elif self.path == "/metrics":
            self.reply(200, self.state.metrics(), "text/plain")
        elif self.path == "/v1/models":
            self.reply(200, {"object": "list", "data": [{"id": self.state.model, "object": "model", "created": 0,
                                                          "owned_by": "vllm"}]})
        else:
            self.reply(404, {"error": {"message": "not found", "code": 404}})

    def do_POST(self):  # noqa: N802
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            body = json.loads(raw)
            if self.path == "/detokenize":
                return self.reply(200, {"prompt": detokenize(body["tokens"])})
            chat = self.path == "/v1/chat/completions"
            if not chat and self.path != "/v1/completions":
                raise Invalid(404, "not found")
            prompt_ids, choices = choices_for(self.state, body, chat)
        except Invalid as exc:
            return self.reply(exc.status, {"error": {"message": str(exc), "type": "BadRequestError",
                                                     "code": exc.status}})
        except (ValueError, KeyError, TypeError) as exc:
            return self.reply(400, {"error": {"message": f"invalid request: {exc}", "code": 400}})
        if body.get("stream"):
            return self.stream(body, chat, prompt_ids, choices)
        top = (body.get("top_logprobs") or 0) if chat else (body.get("logprobs") or 0)
        want_logprobs = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
        ids_too = bool(body.get("return_token_ids"))
        out = []
        for c in choices:
            d = dict(index=c["index"], finish_reason=c["finish"],
                     logprobs=logprobs_of(c["ids"], top, chat) if want_logprobs else None)
            if chat:
                d["message"] = {"role": "assistant", "content": c["text"]}
            else:
                d["text"] = c["text"]
                d["prompt_token_ids"] = prompt_ids if ids_too else None
            d["token_ids"] = c["ids"] if ids_too else None
            out.append(d)
        usage = dict(prompt_tokens=len(prompt_ids), completion_tokens=sum(len(c["ids"]) for c in choices))
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        doc = dict(id="cmpl-fake", object="chat.completion" if chat else "text_completion", created=int(time.time()),
                   model=self.state.model, choices=out, usage=usage)
        if chat and ids_too:
            doc["prompt_token_ids"] = prompt_ids
        self.reply(200, doc)

    def stream(self, body: dict, chat: bool, prompt_ids: list[int], choices: list[dict]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choice_list, usage=None):
            doc = dict(id="cmpl-fake", object=kind, created=0, model=self.state.model, choices=choice_list)
            if usage is not None:
                doc["usage"] = usage
            self.wfile.write(f"data: {json.dumps(doc)}\n\n".encode())
            self.wfile.flush()

        tokens = len(prompt_ids) + sum(len(c["ids"]) for c in choices)
        self.state.admit(tokens)
        aborted = False
        try:
            for c in choices:
                for k, i in enumerate(c["ids"]):
                    last = k == len(c["ids"]) - 1
                    piece = detokenize([i])
                    part = {"delta": {"content": piece}} if chat else {"text": piece}
                    event([dict(index=c["index"], finish_reason=c["finish"] if last else None, **part)])
                    time.sleep(0.005)
            if (body.get("stream_options") or {}).get("include_usage"):
                n = sum(len(c["ids"]) for c in choices)
                event([], dict(prompt_tokens=len(prompt_ids), completion_tokens=n, total_tokens=len(prompt_ids) + n))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            aborted = True
        finally:
            self.state.release(tokens, aborted)


def serve(model: str, kv_tokens: int | None = None) -> tuple[http.server.ThreadingHTTPServer, int]:
    """A fake server for model on a free port of 127.0.0.1, serving from a daemon thread; (server, port). kv_tokens:
    the KV budget past which a starting stream counts a preemption (None: never)."""
    handler = type("FakeHandler", (Handler,), {"state": State(model, kv_tokens)})
    # a listen backlog for 100+ clients at once (vLLM's uvicorn: 2048; http.server's default: 5)
    listening = type("Listening", (http.server.ThreadingHTTPServer,), {"request_queue_size": 256})
    server = listening(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]
