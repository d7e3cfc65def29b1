"""Quality of each KV cache in real vLLM: perplexity, pass-key retrieval, KL from bf16, bytes per token.

One small reference Llama (HF directory: config.json, safetensors, tokenizer.json), one run, each
KV cache in its own process (vLLM engines do not tear down cleanly in one), bf16 first.

- ppl_wikitext2 / ppl_heldout: the text (WikiText-2 test; the first --heldout-windows windows of a
  val.bin of uint16 ids) cut into non-overlapping windows of the model's full context, each one
  BOS (if the tokenizer puts one first) + the next context - 1 tokens; a last partial window is
  dropped. vLLM scores them with SamplingParams(max_tokens=1, prompt_logprobs=0): the log-prob
  of every actual token given the tokens before it in its window. The first token of each window
  has no prediction and is excluded, so with a BOS every text token of the full windows is scored
  exactly once. PPL = exp(mean NLL over the scored tokens). vLLM refuses a prompt as long as
  max_model_len (it wants room for one output token), so the engine runs with max_model_len =
  context + 1 (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1); position `context` is never computed: max_tokens=1
  samples that token without running it through the model.
- Prefill in chunks of --prefill-chunk tokens (64; the scheduler's long_prefill_token_threshold), in
  every engine alike: vLLM's in-tree TurboQuant attends to the raw K/V within a sequence's first
  prefill chunk and reads its compressed cache only in later chunks (chunks of <= 128 tokens go
  through its decode kernel over the stored cache). Unchunked, one 4096-token prefill would score
  it on uncompressed K/V; chunked, only the first chunk's tokens of each window are (1.5% at 64).
  Ours and FLASH_ATTN attend to their cache in prefill anyway; for them the chunking changes nothing.
- needle_accuracy: pass-key retrieval in a Paul Graham essay haystack, prompts from
  reference_lm/passkey.py (the format training used): for every (context length, depth) cell,
  --needles prompts with fresh 5-digit keys at random haystack offsets (seeded), greedy decoding;
  a hit is the exact answer tokens (" " + the key's digits) not followed by another digit.
- kl_vs_bf16: next-token KL(P_bf16 || Q) over the full vocabulary, estimated through vLLM alone.
  The bf16 process samples --kl-tokens tokens (temperature 1, per-request seeds) after each of
  --kl-prompts random held-out windows and scores prompt + continuation with prompt_logprobs=0;
  it saves the sequences and its log-probs in the work dir. Every KV cache scores the same
  sequences. A sampled token x_t is drawn from P(. | x_<t), so E[log P(x_t) - log Q(x_t)] is
  exactly KL(P || Q) at that position: the mean of log P - log Q over the sampled positions is an
  unbiased estimate of the mean per-token KL (nats), with no top-k truncation of either
  distribution (the sampler's decode-time P and the scored P differ only by bf16 rounding
  between vLLM's decode and prefill paths). Its standard error is taken over sequences (tokens
  within one are correlated).
  bf16's own value is 0 by construction (its scores are the reference).
- bytes_per_token: K+V bytes per token per KV head, averaged over layers as vLLM allocates the
  pages (read from the worker's KV cache config); bytes_per_token_formula is the same from the
  presets (ours), 2 x head_dim x dtype size (bf16, fp8), or vLLM's TurboQuantConfig slot size with
  its bf16 boundary layers (the in-tree turboquant_* leave the first and last 2 layers
  uncompressed).

On the GPU machine, from the repository root (inputs must lie inside the repo tree to travel):
    python -m benchmarks quality --model MODEL_DIR --wikitext data/wikitext2-test.txt \\
        --heldout data/val.bin --haystack data/paul_graham_essays [--kv bf16,tq4] [--merge] [--parallel 3]
--parallel N runs the KV caches after bf16 N at once on the one GPU, each with min(--gpu-memory-utilization,
0.85 / N) of its memory, a new one starting only once the running ones have their engines up.
Writes --out (the headline benchmarks/results/quality.json) after every KV cache, the children's logs in the folder
of its name (benchmarks/results/quality/<gpu>-children.log), and prints the table. Rendering is a separate, local
step:
    python -m benchmarks quality --report benchmarks/results/quality.json
writes quality.md, quality.png (quality vs bytes, Pareto front) beside the JSON (or in --results-dir), and in the
folder of its name (benchmarks/results/quality/) needle.png (every cache) and needle/<kv>.png (one heatmap per KV
cache).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from importlib import metadata
from pathlib import Path

from turboquant_vllm.core.presets import PRESETS  # ours, in table order

from . import common

NAME = "quality"

CALIBRATED = "-cal"
# kv name -> (attention backend, kv_cache_dtype, extra environment); bf16 first: it makes the KL reference
KV = {
    "bf16": ("FLASH_ATTN", "auto", {}),
    "fp8": ("FLASH_ATTN", "fp8", {}),
    **{name: (None, name, {}) for name in
       ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")},
    **{name: ("CUSTOM", "auto", {"TURBOQUANT_PRESET": name}) for name in PRESETS},
    # ours with the key calibration of --key-calibration (core.calibration): same bytes, same preset
    **{f"{name}{CALIBRATED}": ("CUSTOM", "auto", {"TURBOQUANT_PRESET": name}) for name in PRESETS},
}
ANCHORS = ("Published anchors (other models, not this one): vLLM's in-tree TurboQuant, WikiText-2 PPL vs bf16: "
           "turboquant_k8v4 +1.17%, turboquant_4bit_nc +2.71%, turboquant_k3v4_nc +10.6%, turboquant_3bit_nc "
           "+20.6%; TurboQuant paper, needle-in-a-haystack: 0.997.")
ROW_TAG = "QUALITY_ROW "
MAX_SEQS = 256  # all prompts of a metric at once (the needle grid has 200)
PARALLEL_GPU = 0.85  # of the GPU's memory, split among the children of --parallel N > 1
GPU_SHARE = "QUALITY_GPU_MEMORY_UTILIZATION"  # a parallel child's share, over inputs.json's


# ---- pure pieces (unit-tested) -------------------------------------------------------------

def windows(ids: list[int], context: int, prefix: list[int]) -> list[list[int]]:
    """Non-overlapping windows of `context` tokens: prefix (the BOS, if any) + the next stretch of ids."""
    step = context - len(prefix)
    return [prefix + ids[i:i + step] for i in range(0, len(ids) - step + 1, step)]


def perplexity(logprobs: list[list[float]]) -> tuple[float, int]:
    flat = [x for seq in logprobs for x in seq]
    return math.exp(-sum(flat) / len(flat)), len(flat)


def kl_estimate(ref: list[list[float]], q: list[list[float]]) -> tuple[float, float, int]:
    """Mean of log P - log Q over tokens sampled from P, its standard error over sequences, the token count.

    Sequences have equal lengths, so the token mean is the mean of the sequence means."""
    per_seq = [statistics.fmean(p - x for p, x in zip(r, s)) for r, s in zip(ref, q)]
    stderr = statistics.stdev(per_seq) / math.sqrt(len(per_seq)) if len(per_seq) > 1 else float("nan")
    return statistics.fmean(per_seq), stderr, sum(map(len, ref))


def needle_prompts(codec, hay: list[int], lengths: list[int], depths: list[int], n: int, seed: int = 0) -> list[dict]:
    """n prompts per (length, depth %) cell, each with a fresh key and a random stretch of the haystack."""
    from reference_lm import passkey

    rng = random.Random(seed)
    cells = []
    for length in lengths:
        for depth in depths:
            for key in rng.sample(range(*passkey.KEY_RANGE), n):
                start = rng.randrange(len(hay) - length)
                ids, at = passkey.build_prompt(codec, hay[start:start + length], key, length, depth / 100)
                cells.append(dict(length=length, depth=depth, key=key, at=at, ids=ids,
                                  answer=codec.ids("answer", key)))
    return cells


def answer_matches(generated: list[int], answer: list[int], digits: list[int]) -> bool:
    """The exact answer tokens, not followed by one more digit."""
    n = len(answer)
    return generated[:n] == answer and (len(generated) == n or generated[n] not in digits)


def needle_grid(cells: list[dict], hits: list[bool]) -> dict:
    """Accuracy per (depth, length) cell: rows are depths, columns context lengths."""
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    acc = [[statistics.fmean(h for c, h in zip(cells, hits) if c["depth"] == d and c["length"] == n)
            for n in lengths] for d in depths]
    return dict(lengths=lengths, depths=depths, accuracy=acc, per_cell=len(cells) // (len(lengths) * len(depths)))


def bytes_formula(kv: str, num_layers: int, head_dim: int) -> float:
    """K+V bytes per token per KV head, averaged over layers, from each cache's definition."""
    if kv in ("bf16", "fp8"):
        return 2 * head_dim * (2 if kv == "bf16" else 1)
    if kv.startswith("turboquant_"):  # vLLM's own sizing; its boundary layers stay bf16
        from types import SimpleNamespace

        from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

        slot = TurboQuantConfig.from_cache_dtype(kv, head_dim).slot_size_aligned
        model = SimpleNamespace(is_hybrid=False, hf_text_config=SimpleNamespace(num_hidden_layers=num_layers))
        skipped = len(TurboQuantConfig.get_boundary_skip_layers(model))
        return (skipped * 4 * head_dim + (num_layers - skipped) * slot) / num_layers
    from turboquant_vllm.core.presets import get_preset

    return get_preset(kv.removesuffix(CALIBRATED)).bytes_per_token_per_head(head_dim)


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both x and y (lower is better), by x."""
    front = [i for i, (x, y) in enumerate(points)
             if not any(a <= x and b <= y and (a, b) != (x, y) for a, b in points)]
    return sorted(front, key=lambda i: points[i])


# ---- inputs: tokenized once, by the parent ------------------------------------------------

def prepare(args) -> dict:
    """Every prompt of the run as token ids, so the children need no tokenizer."""
    import numpy as np
    from transformers import AutoTokenizer

    cfg = json.loads((Path(args.model) / "config.json").read_text())
    context = cfg["max_position_embeddings"]
    tok = AutoTokenizer.from_pretrained(args.model)
    prefix = [tok.bos_token_id] if tok.encode("a")[:1] == [tok.bos_token_id] else []
    wiki = tok(Path(args.wikitext).read_text(), add_special_tokens=False)["input_ids"] if args.wikitext else []
    held = np.fromfile(args.heldout, np.uint16).tolist() if args.heldout else []
    inp = dict(model=str(Path(args.model).resolve()), context=context, prefix=prefix, scored_from=max(1, len(prefix)),
               num_layers=cfg["num_hidden_layers"], head_dim=cfg.get("head_dim") or
               cfg["hidden_size"] // cfg["num_attention_heads"], gpu_memory_utilization=args.gpu_memory_utilization,
               kl_tokens=args.kl_tokens, prefill_chunk=args.prefill_chunk)
    inp["wikitext2"] = windows(wiki, context, prefix)[:args.wikitext_windows or None]
    inp["heldout"] = windows(held[:args.heldout_windows * context], context, prefix)[:args.heldout_windows]

    lo, hi = map(int, args.kl_prompt_len.split(","))
    assert hi + args.kl_tokens <= context, "KL prompt + continuation must fit the context"
    source, rng = held or wiki, random.Random(0)
    inp["kl_prompts"] = []
    for _ in range(args.kl_prompts if source else 0):
        n = rng.randint(lo, hi) - len(prefix)
        start = rng.randrange(len(source) - n)
        inp["kl_prompts"].append(prefix + source[start:start + n])

    inp["needles"] = []
    if args.haystack:
        from reference_lm.passkey import PasskeyCodec

        codec = PasskeyCodec.from_tokenizer(tok, tok.bos_token_id, tok.eos_token_id)
        text = "\n\n".join(p.read_text() for p in sorted(Path(args.haystack).glob("*.txt")))
        hay = tok(text, add_special_tokens=False)["input_ids"]
        lengths = [int(x) for x in args.lengths.split(",")]
        depths = [int(x) for x in args.depths.split(",")]
        assert max(lengths) < context, "a needle prompt needs room for its answer"
        inp["needles"] = needle_prompts(codec, hay, lengths, depths, args.needles)
        inp["digits"] = codec.digits
    return inp


# ---- one KV cache, in its own process ------------------------------------------------------

def layer_bytes(worker) -> dict[str, float]:
    """Runs on the vLLM worker: bytes per token per KV head of each layer's pages, as allocated."""
    config = worker.model_runner.kv_cache_config
    out = {}
    for group in config.kv_cache_groups:
        for name in group.layer_names:
            spec = getattr(group.kv_cache_spec, "kv_cache_specs", {}).get(name, group.kv_cache_spec)
            out[name] = spec.page_size_bytes / (spec.block_size * spec.num_kv_heads)
    return out


def evaluate(kv: str, work: Path) -> None:
    """Every metric for one KV cache; prints the row after each one, so a crash keeps what came before."""
    import torch
    from vllm import LLM, SamplingParams

    inp = json.loads((work / "inputs.json").read_text())
    backend, dtype, _ = KV[kv]
    share = float(os.environ.get(GPU_SHARE, inp["gpu_memory_utilization"]))
    t0 = time.perf_counter()
    llm = LLM(model=inp["model"], skip_tokenizer_init=True, max_model_len=inp["context"] + 1, enforce_eager=True,
              gpu_memory_utilization=share, enable_prefix_caching=False, seed=0,
              enable_chunked_prefill=True, long_prefill_token_threshold=inp["prefill_chunk"], max_num_seqs=MAX_SEQS,
              max_num_batched_tokens=MAX_SEQS * inp["prefill_chunk"],  # every running sequence gets its chunk
              kv_cache_dtype=dtype, **({"attention_config": {"backend": backend}} if backend else {}))
    cache = llm.llm_engine.vllm_config.cache_config
    row = dict(kv=kv, kv_tokens=cache.num_gpu_blocks * cache.block_size, gpu_memory_utilization=share,
               device=torch.cuda.get_device_name(), seconds_by_step={})
    try:  # reads vLLM internals: if that breaks, the formula stands in and the metrics still run
        per_layer = llm.collective_rpc(layer_bytes)[0]
        by_layer = sorted(per_layer, key=lambda name: [int(d) for d in re.findall(r"\d+", name)])
        row["bytes_per_layer"] = [per_layer[name] for name in by_layer]
        row["bytes_per_token_runtime"] = statistics.fmean(row["bytes_per_layer"])
    except Exception as e:
        row["bytes_runtime_error"] = repr(e)

    def emit(step: str, t: float) -> None:
        row["seconds_by_step"][step] = time.perf_counter() - t
        print(ROW_TAG + json.dumps(row), flush=True)

    def score(seqs: list[list[int]], starts: list[int]) -> list[list[float]]:
        """Log-prob of each token from its sequence's start index on, given the tokens before it."""
        outs = llm.generate([{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=0),
                            use_tqdm=False)
        return [[o.prompt_logprobs[t][s[t]].logprob for t in range(b, len(s))] for o, s, b in zip(outs, seqs, starts)]

    emit("startup", t0)
    for name in ("wikitext2", "heldout"):
        if inp[name]:
            t = time.perf_counter()
            logprobs = score(inp[name], [inp["scored_from"]] * len(inp[name]))
            row[f"ppl_{name}"], row[f"{name}_tokens"] = perplexity(logprobs)
            emit(name, t)

    t, ref_path = time.perf_counter(), work / "kl_reference.json"
    if kv == "bf16" and inp["kl_prompts"]:
        prompts = inp["kl_prompts"]
        params = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=inp["kl_tokens"], ignore_eos=True, seed=i)
                  for i in range(len(prompts))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
        starts = [len(p) for p in prompts]
        ref_path.write_text(json.dumps(dict(model=inp["model"], sequences=seqs, starts=starts,
                                            logprobs=score(seqs, starts))))
    ref = json.loads(ref_path.read_text()) if ref_path.exists() else {}
    if ref.get("model") == inp["model"]:  # a reference of another model's run would mean nothing
        mine = ref["logprobs"] if kv == "bf16" else score(ref["sequences"], ref["starts"])
        row["kl_vs_bf16"], row["kl_stderr"], row["kl_tokens"] = kl_estimate(ref["logprobs"], mine)
        emit("kl", t)

    if inp["needles"]:
        t, cells = time.perf_counter(), inp["needles"]
        params = SamplingParams(temperature=0.0, max_tokens=len(cells[0]["answer"]) + 1)
        outs = llm.generate([{"prompt_token_ids": c["ids"]} for c in cells], params, use_tqdm=False)
        hits = [answer_matches(list(o.outputs[0].token_ids), c["answer"], inp["digits"]) for o, c in zip(outs, cells)]
        row["needle_accuracy"], row["needle_grid"] = statistics.fmean(hits), needle_grid(cells, hits)
        emit("needle", t)


# ---- the run: one child per KV cache -------------------------------------------------------

def child_command(kv: str, work: Path) -> list[str]:
    """python -m benchmarks.quality --child KV (run with common.child_env: the repository root on PYTHONPATH)."""
    return common.module_command(NAME, "--child", kv, "--work", str(Path(work).resolve()))


def child(kv: str, work: Path, env: dict, timeout: float, startup: threading.Lock) -> tuple[str, str, int, float]:
    """One KV cache's process: its stdout, stderr, exit code and seconds. Afterwards its whole session is killed, so
    no engine process keeps GPU memory.

    It holds `startup` until its first row (its engine is up) or its end: vLLM sizes its cache from the GPU memory it
    profiles at startup, which an engine allocating beside it at the same time would throw off."""
    stdout, stderr, up = [], [], threading.Event()

    def read(stream, lines: list[str]) -> None:  # as it comes: the first row must be seen while the child runs
        with stream:
            for line in stream:
                lines.append(line)
                if line.startswith(ROW_TAG):
                    up.set()

    with startup:
        t0 = time.perf_counter()
        deadline = t0 + (timeout or math.inf)
        proc = subprocess.Popen(child_command(kv, work), env=common.child_env(env), text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        readers = [threading.Thread(target=read, args=(proc.stdout, stdout)),
                   threading.Thread(target=read, args=(proc.stderr, stderr))]
        for reader in readers:
            reader.start()
        while not up.wait(0.1) and proc.poll() is None and time.perf_counter() < deadline:  # up, ended or out of time
            pass
    note = ""
    try:
        proc.wait(max(0.0, deadline - time.perf_counter()) if timeout else None)
    except subprocess.TimeoutExpired:
        note = f"\nTimeoutError: killed after {timeout:.0f} s"
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for reader in readers:  # the session is gone: every pipe is at its end
        reader.join()
    return "".join(stdout), "".join(stderr) + note, proc.returncode, time.perf_counter() - t0


def run(args) -> None:
    out, work = Path(args.out), Path(args.work)
    out.parent.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    chosen = args.kv.split(",")
    unknown = set(chosen) - set(KV)
    assert not unknown, f"unknown KV caches {unknown}; choose from {', '.join(KV)}"
    assert args.parallel >= 1, "--parallel must be at least 1"
    calibration = {}
    if any(kv.endswith(CALIBRATED) for kv in chosen):
        assert args.key_calibration, f"the {CALIBRATED} caches need --key-calibration"
        calibration = {"TURBOQUANT_KEY_CALIBRATION": str(Path(args.key_calibration).resolve())}
    share = args.gpu_memory_utilization  # of the GPU, for each child after bf16
    if args.parallel > 1:  # side by side on one GPU: vLLM refuses to start when its share is not free
        share = min(share, PARALLEL_GPU / args.parallel)
    t0 = time.perf_counter()
    inp = prepare(args)
    (work / "inputs.json").write_text(json.dumps(inp))
    command = common.command_line(NAME, getattr(args, "argv", None))
    provenance = common.provenance(command)
    doc = dict(model=Path(args.model).name, rows=[], commands=[])
    if args.merge and out.exists():  # keep the other KV caches' rows of an earlier call
        doc = json.loads(out.read_text())
        doc.pop("meta", None)  # this call's provenance replaces the earlier one's; merged rows keep their command
        doc["rows"] = [r for r in doc["rows"] if r["kv"] not in chosen]
    doc["commands"].append(command)
    doc.update(vllm=metadata.version("vllm"), work=str(work), settings=dict(
        context=inp["context"], bos=bool(inp["prefix"]), num_layers=inp["num_layers"], head_dim=inp["head_dim"],
        wikitext2_windows=len(inp["wikitext2"]), heldout_windows=len(inp["heldout"]), kl_prompts=len(inp["kl_prompts"]),
        kl_prompt_len=args.kl_prompt_len.replace(",", "-"), kl_tokens=args.kl_tokens, needle_lengths=args.lengths,
        needle_depths=args.depths, needles_per_cell=args.needles, prefill_chunk=args.prefill_chunk,
        gpu_memory_utilization=args.gpu_memory_utilization, parallel=args.parallel,
        parallel_gpu_memory_utilization=share, prepare_seconds=time.perf_counter() - t0))
    if calibration:
        doc["key_calibration"] = args.key_calibration
    log = children_log(out, provenance["gpu"])
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    startup = threading.Lock()

    def measure(kv: str, share_env: dict) -> tuple[str, str, str, int, float]:
        # max_model_len = context + 1 (see the docstring); collective_rpc ships layer_bytes (a function) to the worker
        env = dict(os.environ, VLLM_ALLOW_LONG_MAX_MODEL_LEN="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1", **KV[kv][2],
                   **(calibration if kv.endswith(CALIBRATED) else {}), **share_env)
        return kv, *child(kv, work, env, args.child_timeout, startup)

    def record(kv: str, stdout: str, stderr: str, rc: int, seconds: float) -> None:
        with log.open("a") as f:
            f.write(f"==== {kv} (rc {rc})\n{stdout[-20000:]}\n{stderr[-20000:]}\n")
        found = [line[len(ROW_TAG):] for line in stdout.splitlines() if line.startswith(ROW_TAG)]
        row = json.loads(found[-1]) if found else {"kv": kv}
        if rc or not found:
            row["error"] = "\n".join(stderr.strip().splitlines()[-12:]) or f"exit code {rc}"
        if "device" in row:
            doc["device"] = row.pop("device")
        row["bytes_per_token_formula"] = bytes_formula(kv, inp["num_layers"], inp["head_dim"])
        row["bytes_per_token"] = row.get("bytes_per_token_runtime", row["bytes_per_token_formula"])
        row["seconds"] = seconds
        row["command"] = command  # rows merged from other calls keep theirs
        doc["rows"] = sorted(doc["rows"] + [row], key=lambda r: list(KV).index(r["kv"]))
        common.write_json(out, doc, provenance)  # after every KV cache: a cut-off run keeps what it measured
        print(f"{kv}: {row.get('error', 'ok').splitlines()[-1]} ({row['seconds']:.0f} s)", flush=True)

    order = [k for k in KV if k in chosen]
    if "bf16" in order:  # first and alone: the others' KL needs its reference
        record(*measure("bf16", {}))
    with ThreadPoolExecutor(args.parallel) as pool:  # the rest, up to --parallel at once
        running = [pool.submit(measure, kv, {GPU_SHARE: str(share)}) for kv in order if kv != "bf16"]
        for done in as_completed(running):
            record(*done.result())
    print(markdown(doc))


# ---- the report: markdown and figures, rendered locally -------------------------------------

def children_log(out: Path, gpu: str | None) -> Path:
    """The children's output: <folder of out's name>/<gpu>-children.log (benchmarks/results/quality/h100-...)."""
    return common.stem_of(out) / f"{common.gpu_tag(gpu)}-children.log"


def _pct(x, base) -> str:
    return "" if x is None else f"{x:.3f}" + (f" ({(x / base - 1) * 100:+.2f}%)" if base else "")


def markdown(doc: dict) -> str:
    rows = doc["rows"]
    base = next((r for r in rows if r["kv"] == "bf16"), {})  # what a cut-off bf16 run measured still holds
    lines = ["| kv | bytes/token/head | PPL WikiText-2 | PPL held-out | needle | KL vs bf16 (nats/token) | "
             "KV tokens | s |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        kl = "" if r.get("kl_vs_bf16") is None else f"{r['kl_vs_bf16']:.3g} ± {r['kl_stderr']:.2g}"
        needle = "" if r.get("needle_accuracy") is None else f"{r['needle_accuracy']:.3f}"
        lines.append(f"| {r['kv']}{' (failed)' if 'error' in r else ''} | {r['bytes_per_token']:.1f} | "
                     f"{_pct(r.get('ppl_wikitext2'), base.get('ppl_wikitext2'))} | "
                     f"{_pct(r.get('ppl_heldout'), base.get('ppl_heldout'))} | {needle} | {kl} | "
                     f"{format(r['kv_tokens'], ',') if 'kv_tokens' in r else ''} | {r.get('seconds', 0):.0f} |")
    s = doc.get("settings", {})
    shared = [(f"The KV caches after bf16 ran {s['parallel']} at once on the one GPU, each with gpu_memory_utilization "
               f"{s['parallel_gpu_memory_utilization']:.3g} (bf16: {s['gpu_memory_utilization']}): their KV tokens "
               "reflect that smaller share, and their seconds overlap.")] if s.get("parallel", 1) > 1 else []
    calls: dict[str, list[str]] = {}  # rows merged (--merge) from other calls name the call that measured them
    for r in rows:
        calls.setdefault(r.get("command", "unrecorded"), []).append(r["kv"])
    measured = [f"Measured by `{cmd}`: {', '.join(kvs)}." for cmd, kvs in calls.items()] if len(calls) > 1 else []
    notes = [
        f"Model `{doc['model']}`, vLLM {doc.get('vllm', '?')}, {doc.get('device', '?')}; context {s.get('context')}.",
        f"PPL: {s.get('wikitext2_windows')} WikiText-2 / {s.get('heldout_windows')} held-out windows of the full "
        f"context{', BOS first' if s.get('bos') else ''}, the first token of each window not scored, prefill in "
        f"chunks of {s.get('prefill_chunk')} tokens (so the in-tree turboquant_* read their compressed cache); "
        "% vs bf16 in brackets.",
        f"Needle: lengths {s.get('needle_lengths')}, depths {s.get('needle_depths')} %, {s.get('needles_per_cell')} "
        "keys per cell, greedy, exact match.",
        f"KL: {s.get('kl_prompts')} held-out prompts of {s.get('kl_prompt_len')} tokens + {s.get('kl_tokens')} "
        "tokens sampled by bf16 (T = 1); mean of log P_bf16 - log Q over the sampled tokens ± standard error.",
        "bytes/token/head: K+V per token per KV head, averaged over layers as vLLM allocates the pages; "
        "the in-tree turboquant_* keep the first and last 2 layers in bf16 (512 B).",
        ANCHORS,
        *shared,
        *measured,
    ] + ([f"*{CALIBRATED}: the same preset with the key calibration `{doc['key_calibration']}` (core.calibration: "
          "keys cached as (k - mean) / scale, queries times scale; no bytes per token)."]
         if doc.get("key_calibration") else []) + [f"{r['kv']} failed: `{r['error'].splitlines()[-1]}`" for r in rows if "error" in r]
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"


def _family(kv: str) -> str:
    return "in-tree TurboQuant" if kv.startswith("turboquant_") else "baseline" if kv in ("bf16", "fp8") else "ours"


def plot(doc: dict, results: Path, needles: Path) -> None:
    """results/quality.png; needles.png and needles/<kv>.png: the needle heatmaps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if "bytes_per_token" in r]
    base = next((r for r in rows if r["kv"] == "bf16"), {})
    panels = [(f"ppl_{n}", f"PPL {t}, % vs bf16") for n, t in (("wikitext2", "WikiText-2"), ("heldout", "held-out"))
              if base.get(f"ppl_{n}")] + [("kl_vs_bf16", "KL vs bf16 (nats/token)")]
    colors = {"baseline": "gray", "in-tree TurboQuant": "tab:orange", "ours": "tab:blue"}
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        pts = [(r["bytes_per_token"], r[key] if key == "kl_vs_bf16" else (r[key] / base[key] - 1) * 100, r["kv"])
               for r in rows if r.get(key) is not None]
        for x, y, kv in pts:
            ax.scatter(x, y, color=colors[_family(kv)], zorder=3)
            ax.annotate(kv, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        front = [pts[i] for i in pareto([(x, y) for x, y, _ in pts])]
        ax.step([x for x, _, _ in front], [y for _, y, _ in front], where="post", color="black", lw=1, ls="--",
                label="Pareto front")
        for fam, c in colors.items():
            ax.scatter([], [], color=c, label=fam)
        ax.set(title=title, xlabel="bytes per token per KV head (K+V)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{doc['model']}: quality vs KV cache size (lower left is better)")
    fig.tight_layout()
    fig.savefig(results / "quality.png", dpi=120)
    plt.close(fig)

    grids = [r for r in rows if r.get("needle_grid")]
    cols = max(1, min(4, len(grids)))
    lines = max(1, math.ceil(len(grids) / cols))
    fig, axes = plt.subplots(lines, cols, figsize=(3.6 * cols, 3.2 * lines), squeeze=False)
    for ax in axes.flat[len(grids):]:
        ax.axis("off")
    for ax, r in zip(axes.flat, grids):
        _needle_heatmap(ax, r)
    fig.suptitle(f"{doc['model']}: pass-key accuracy")
    fig.tight_layout()
    needles.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(common.with_ext(needles, ".png"), dpi=120)
    plt.close(fig)
    needles.mkdir(exist_ok=True)
    for r in grids:  # and one file per KV cache
        fig, ax = plt.subplots(figsize=(4.2, 3.6))
        _needle_heatmap(ax, r)
        fig.suptitle(f"{doc['model']}: pass-key accuracy", fontsize=9)
        fig.tight_layout()
        fig.savefig(needles / f"{r['kv']}.png", dpi=120)
        plt.close(fig)


def _needle_heatmap(ax, row: dict) -> None:
    g = row["needle_grid"]
    ax.imshow(g["accuracy"], vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i, line in enumerate(g["accuracy"]):
        for j, a in enumerate(line):
            ax.text(j, i, f"{a:.1f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(g["lengths"])), g["lengths"], fontsize=7)
    ax.set_yticks(range(len(g["depths"])), [f"{d}%" for d in g["depths"]], fontsize=7)
    ax.set(title=f"{row['kv']}: {row['needle_accuracy']:.3f}", xlabel="context length", ylabel="needle depth")


def report(path: Path, results: Path) -> None:
    """results/quality.md and quality.png, results/quality/needle.png and needle/<kv>.png."""
    doc = json.loads(path.read_text())
    results.mkdir(parents=True, exist_ok=True)
    text = markdown(doc)
    if doc.get("meta"):  # a file from before the provenance was recorded renders without its header
        common.write_markdown(results / "quality.md", text, doc["meta"])
    else:
        (results / "quality.md").write_text(text)
    plot(doc, results, results / NAME / "needle")


def parser() -> argparse.ArgumentParser:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--model", help="HF model directory (config.json, safetensors, tokenizer.json)")
    ap.add_argument("--wikitext", help="WikiText-2 test split, raw text")
    ap.add_argument("--heldout", help="held-out token file: flat uint16 ids (val.bin)")
    ap.add_argument("--haystack", help="folder of Paul Graham essays (*.txt)")
    ap.add_argument("--kv", default=",".join(KV))
    ap.add_argument("--wikitext-windows", type=int, default=0, help="score only the first N windows (0: all)")
    ap.add_argument("--heldout-windows", type=int, default=32)
    ap.add_argument("--kl-prompts", type=int, default=32)
    ap.add_argument("--kl-prompt-len", default="1024,2048", help="prompt lengths drawn uniformly from LO,HI")
    ap.add_argument("--kl-tokens", type=int, default=512, help="tokens bf16 samples after each prompt")
    ap.add_argument("--lengths", default="1024,2048,3072,4000", help="needle context lengths")
    ap.add_argument("--depths", default="0,25,50,75,100", help="needle depths, percent")
    ap.add_argument("--needles", type=int, default=10, help="keys per (length, depth) cell")
    ap.add_argument("--prefill-chunk", type=int, default=64,
                    help="prefill tokens per sequence and step, <= 128 (see the docstring)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--out", default=str(common.RESULTS / "quality.json"), help="the results' JSON")
    ap.add_argument("--work", default="/tmp/turboquant_quality",
                    help="inputs and bf16's KL reference; keep it across --merge calls")
    ap.add_argument("--key-calibration", help=f"key calibration file for the *{CALIBRATED} caches "
                    "(turboquant-vllm calibrate)")
    ap.add_argument("--merge", action="store_true", help="keep rows of other KV caches already in --out")
    ap.add_argument("--child-timeout", type=float, default=0, help="seconds per KV cache before it is killed (0: none)")
    ap.add_argument("--parallel", type=int, default=1, metavar="N",
                    help=f"KV caches after bf16 run N at once, each with min(--gpu-memory-utilization, "
                    f"{PARALLEL_GPU} / N) of the GPU")
    ap.add_argument("--report", metavar="JSON", help="render JSON into quality.md / .png (no GPU)")
    ap.add_argument("--results-dir", help="where --report writes (default: beside the JSON)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.argv = argv
    if args.report:
        report(Path(args.report), Path(args.results_dir or Path(args.report).parent))
    elif args.child:
        evaluate(args.child, Path(args.work))
    else:
        assert args.model, "--model is required"
        run(args)


if __name__ == "__main__":
    main()
