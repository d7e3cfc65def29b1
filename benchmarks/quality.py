"""Quality of each KV cache in real vLLM: perplexity, pass-key retrieval, KL from bf16, bytes per token.

Any Llama-style HF model directory (config.json, safetensors, a tokenizer that transformers' AutoTokenizer loads):
its context is the config's max_position_embeddings (8k for SmolLM2-135M-Instruct, 4k for the reference LM). One
run, each KV cache in its own process (vLLM engines do not tear down cleanly in one).

- ppl_wikitext2 / ppl_heldout: the text (WikiText-2 test; the first --heldout-windows windows of a val.bin of uint16
  ids, if given) cut into non-overlapping windows of the model's full context, each one BOS (if the tokenizer puts
  one first) + the next context - 1 tokens; a last partial window is dropped. vLLM scores them with
  SamplingParams(max_tokens=1, prompt_logprobs=0): the log-prob of every actual token given the tokens before it in
  its window. The first token of each window has no prediction and is excluded, so with a BOS every text token of
  the full windows is scored exactly once. PPL = exp(mean NLL over the scored tokens); its change vs bf16 has a
  standard error over windows (paired: the same windows). vLLM refuses a prompt as long as max_model_len (it wants
  room for one output token), so the engine runs with max_model_len = context + 1
  (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1); position `context` is never computed: max_tokens=1 samples that token without
  running it through the model.
- Prefill in chunks of --prefill-chunk tokens (64; the scheduler's long_prefill_token_threshold), in every engine
  alike: vLLM's in-tree TurboQuant attends to the raw K/V within a sequence's first prefill chunk and reads its
  compressed cache only in later chunks (chunks of <= 128 tokens go through its decode kernel over the stored
  cache). Unchunked, one full-context prefill would score it on uncompressed K/V; chunked, only the first chunk's
  tokens of each window are (0.8% at 64 of 8k). Ours and FLASH_ATTN attend to their cache in prefill anyway; for
  them the chunking changes nothing.
- needle_accuracy: pass-key retrieval in a Paul Graham essay haystack: for every (context length, depth) cell,
  --needles prompts with fresh 5-digit keys at random haystack offsets (seeded), greedy decoding of 8 tokens; a hit
  is the key (after optional white space) not followed by another digit. Formats (--needle-format):
    passkey: reference_lm/passkey.py's texts (the reference LM's training format): [BOS] + essay text with the
      needle "The pass key is 12345. Remember it. 12345 is the pass key." at its depth + "What is the pass key? The
      pass key is", a plain continuation;
    repeat: the same texts in the pass-key test's own haystack (Mohtashami & Jaggi 2023: "The grass is green. The
      sky is blue. The sun is yellow. Here we go. There and back again." over and over) instead of the essays;
    chat: the model's chat template: one user turn (find the pass key hidden in the text below, the essays with the
      needle, the question), the assistant's turn begun with "The pass key is".
  The needle measures the cache, not the model, only where bf16 finds the keys: bf16 runs every format listed and
  keeps the one it answers best (the first listed on a tie; its accuracy in each: needle_by_format), every other KV
  cache runs that one. On a CPU, the converted SmolLM2-135M-Instruct (fp32) found 9 of 10 keys with passkey at 1k,
  5 of 5 at 2k, 4 of 5 at 4k (it missed at depth 100%, as repeat did once), and 6 of 10 with chat at 1k: hence
  passkey,repeat by default. The markdown says so where bf16 finds fewer than 95%.
- kl_vs_bf16: next-token KL(P_bf16 || Q) over the full vocabulary, estimated through vLLM alone. The bf16 process
  samples --kl-tokens tokens (temperature 1, per-request seeds) after each of --kl-prompts random stretches of text
  no PPL scores (--kl-text: books; or the --heldout ids) and scores prompt + continuation with prompt_logprobs=0;
  it saves the sequences and its log-probs in the work dir, its first step. Every KV cache scores the same
  sequences, its last step (waiting for bf16's if need be). A sampled token x_t is drawn from P(. | x_<t), so
  E[log P(x_t) - log Q(x_t)] is exactly KL(P || Q) at that position: the mean of log P - log Q over the sampled
  positions is an unbiased estimate of the mean per-token KL (nats), with no top-k truncation of either
  distribution (the sampler's decode-time P and the scored P differ only by bf16 rounding between vLLM's decode and
  prefill paths). Its standard error is taken over sequences (tokens within one are correlated). bf16's own value
  is 0 by construction (its scores are the reference).
- bytes_per_token_per_head: K+V bytes per token per KV head, averaged over layers as vLLM allocates the pages (read
  from the worker's KV cache config); bytes_per_token_formula is the same from the definitions: the presets (ours,
  with --boundary-layers' layers), 2 x head_dim x dtype size (bf16, fp8), or vLLM's own page arithmetic for its
  caches (common.vllm_bytes_per_token_per_head: the backend's customize_spec), with the in-tree turboquant_*'s bf16
  boundary layers (they leave the first and last 2 layers uncompressed).
- kv_tokens: the tokens of that cache that fit in the --kv-cache-gib GiB every engine gets (vLLM's
  kv_cache_memory_bytes: sized without profiling the GPU that the other children share, so they start side by side
  and every row's KV tokens compare).

KV caches (--kv, rows named as in the JSON's "kv"): bf16 and fp8 (FLASH_ATTN), vLLM's own compressed caches that
run on Hopper, named by their --kv-cache-dtype (common.VLLM_KV: int4 / int8 / fp8_per_token_head on TRITON_ATTN,
turboquant_k8v4 / _4bit_nc / _k3v4_nc / _3bit_nc on their own backend; the others are a line of the report), and
ours (the CUSTOM backend):
PRESET[-cal][+boundary], PRESET one of core.presets. -cal: with a key calibration (TURBOQUANT_KEY_CALIBRATION):
--key-calibration FILE (every -cal row) or ROW=FILE,ROW=FILE, else fitted in this run (--calibration-text, by
turboquant-vllm calibrate's code in a child of its own, tq4's cache, windows of the full context; its statistics
are those of the model's keys and queries, whatever preset then reads the file). +boundary: --additional-config
{"turboquant_layer_presets": {LAYERS: PRESET}} from --boundary-layers (default: the first and last two layers in
bf16).

Scheduling: every child starts at once and imports vLLM (half a minute); then they start their engines in order
(bf16 first, the key calibration next, the -cal rows that wait for it last), --parallel at once. --time-budget
kills what still runs when it is over and starts nothing more, so the JSON is complete before a device call's
limit; the run prints its expected time first.

On the GPU machine, from the repository root (inputs must lie inside the repo tree to travel):
    python -m benchmarks quality --model MODEL_DIR --wikitext data/wikitext2-test.txt \\
        --haystack data/paul_graham_essays --kl-text data/books/kl --calibration-text data/books/calibration \\
        [--heldout data/val.bin] [--kv bf16,tq4] [--merge] [--parallel 4] [--time-budget 540]
writes --out (default benchmarks/results/quality/<model folder>.json) after every KV cache, its markdown at the
end, the children's logs in the folder of its name (quality/<model>/<gpu>-children.log), and prints the table.
A result file is read on a CPU, a separate step that never rewrites it:
    python -m benchmarks quality --report benchmarks/results/quality/smollm2-135m.json [--out PATH]
prints its table; with --out it also writes PATH.md and PATH.png (quality vs bytes, Pareto front), and in the
folder PATH needle.png (every cache) and needle/<kv>.png (one heatmap per KV cache).
CUDA graphs stay off by default (--cuda-graphs: FULL_DECODE_ONLY without torch.compile): the work is prefill in
mixed batches of thousands of tokens, which vLLM does not capture; only bf16's sampling for the KL decodes at
length, and full compilation would cost each KV cache (a new configuration each) its own compile at startup.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from turboquant_vllm.core.presets import PRESETS, get_preset  # ours, in table order
from turboquant_vllm.vllm.settings import parse_layer_presets

from . import common

NAME = "quality"

CALIBRATED, BOUNDARY = "-cal", "+boundary"
IN_TREE = tuple(common.VLLM_KV)  # vLLM's own compressed caches that run on Hopper, named by their kv_cache_dtype
LAYER_PRESETS = "turboquant_layer_presets"  # --additional-config key: layer spec -> preset


@dataclass(frozen=True)
class Cache:
    """How a row's engine keeps its KV cache."""

    backend: str | None  # attention backend; None: the one vLLM picks for kv_cache_dtype
    dtype: str = "auto"  # kv_cache_dtype
    preset: str | None = None  # ours: TURBOQUANT_PRESET
    calibrated: bool = False  # ours with a key calibration file
    boundary: bool = False  # ours with --boundary-layers' per-layer presets


# row name -> cache, in table order; bf16 first: it makes the KL reference
KV: dict[str, Cache] = {
    "bf16": Cache("FLASH_ATTN"),
    "fp8": Cache("FLASH_ATTN", "fp8"),
    **{name: Cache(backend, name) for name, backend in common.VLLM_KV.items()},
    **{f"{p}{cal}{edge}": Cache("CUSTOM", preset=p, calibrated=bool(cal), boundary=bool(edge))
       for p in PRESETS for cal in ("", CALIBRATED) for edge in ("", BOUNDARY)},
}
DEFAULT_KV = ("bf16", "fp8", *IN_TREE, "tq4", "tq4-cal", "tq3", "tq3-cal", "tq4+boundary")
CALIBRATION = "calibration"  # the job that fits the key calibration on --calibration-text
CALIBRATION_PRESET = "tq4"
CALIBRATION_TEXT, CALIBRATION_FILE = "calibration.txt", "key-calibration.safetensors"
# in the work dir: what bf16 hands the others (its KL reference, its needle format) and the mark of its end
KL_REFERENCE, NEEDLE_FORMAT, BF16_ENDED = "kl_reference.json", "needle_format.json", "bf16.ended"

ANCHORS = ("Published anchors (other models, not this one): vLLM's in-tree TurboQuant, WikiText-2 PPL vs bf16: "
           "turboquant_k8v4 +1.17%, turboquant_4bit_nc +2.71%, turboquant_k3v4_nc +10.6%, turboquant_3bit_nc "
           "+20.6%; TurboQuant paper, needle-in-a-haystack: 0.997.")
ROW_TAG, READY = "QUALITY_ROW ", "QUALITY_READY"
MAX_SEQS = 256  # all prompts of a metric at once (the needle grid has 200)
GIB = 1 << 30
STARTUP_CHECK = 0.05  # gpu_memory_utilization: with kv_cache_memory_bytes, vLLM only checks this much is free
CALIBRATION_KV_GIB = 2  # the calibration's windows are prompts only, a few at a time
NEEDLE_TOKENS = 8  # greedy tokens after a needle prompt: " " + 5 digits and what follows
NEEDLE_FORMATS = ("passkey", "chat", "repeat")
# the pass-key test's own haystack (Mohtashami & Jaggi 2023), for the repeat format
REPEAT_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
HAYSTACK = "<<HAYSTACK>>"
CHAT_USER = (f"There is a pass key hidden in the text below. Find it and remember it.\n\n{HAYSTACK}\n\n"
             "What is the pass key?")
CHAT_ANSWER = "The pass key is"
# The time model (H100, vLLM 0.25, the reference LM's run): a child imports vLLM in ~30 s, starts its engine in
# ~15 s; the first in-tree turboquant_* compiles its Triton kernels (~60 s); metrics at ~50k prompt tokens/s per
# engine while --parallel share the GPU (an estimate for a 30-layer 135M model, eager).
IMPORT_SECONDS, ENGINE_SECONDS, IN_TREE_COMPILE_SECONDS, TOKENS_PER_SECOND = 30, 15, 60, 50_000


# ---- pure pieces (unit-tested) -------------------------------------------------------------

def windows(ids: list[int], context: int, prefix: list[int]) -> list[list[int]]:
    """Non-overlapping windows of `context` tokens: prefix (the BOS, if any) + the next stretch of ids."""
    step = context - len(prefix)
    return [prefix + ids[i:i + step] for i in range(0, len(ids) - step + 1, step)]


def perplexity(logprobs: list[list[float]]) -> tuple[float, int]:
    flat = [x for seq in logprobs for x in seq]
    return math.exp(-sum(flat) / len(flat)), len(flat)


def ppl_delta(row: dict, base: dict, name: str = "wikitext2") -> tuple[float, float | None] | None:
    """PPL change vs base in %, and its standard error over the windows both scored (None without them)."""
    if row.get(f"ppl_{name}") is None or not base.get(f"ppl_{name}"):
        return None
    delta = (row[f"ppl_{name}"] / base[f"ppl_{name}"] - 1) * 100
    mine, ref = row.get(f"{name}_window_nll"), base.get(f"{name}_window_nll")
    if not mine or not ref or len(mine) != len(ref) or len(mine) < 2:
        return delta, None
    diff = [a - b for a, b in zip(mine, ref)]  # windows of equal lengths: log PPL ratio = mean diff
    return delta, 100 * math.exp(statistics.fmean(diff)) * statistics.stdev(diff) / math.sqrt(len(diff))


def kl_estimate(ref: list[list[float]], q: list[list[float]]) -> tuple[float, float, int]:
    """Mean of log P - log Q over tokens sampled from P, its standard error over sequences, the token count.

    Sequences have equal lengths, so the token mean is the mean of the sequence means."""
    per_seq = [statistics.fmean(p - x for p, x in zip(r, s)) for r, s in zip(ref, q)]
    stderr = statistics.stdev(per_seq) / math.sqrt(len(per_seq)) if len(per_seq) > 1 else float("nan")
    return statistics.fmean(per_seq), stderr, sum(map(len, ref))


def encode(tok, text: str) -> list[int]:
    """Token ids of text, no BOS / EOS added (special tokens written in it, as in a chat template, stay special)."""
    return tok(text, add_special_tokens=False)["input_ids"]


def bos_prefix(tok) -> list[int]:
    """[BOS] if the tokenizer puts one first (the reference LM), else [] (SmolLM2)."""
    return [tok.bos_token_id] if tok.bos_token_id is not None and tok.encode("a")[:1] == [tok.bos_token_id] else []


def needle_pieces(tok, fmt: str, prefix: list[int]) -> tuple[list[int], list[int]]:
    """The ids before and after the haystack (the needle inside it) in a prompt of format fmt."""
    from reference_lm import passkey

    if fmt in ("passkey", "repeat"):
        return prefix, encode(tok, passkey.QUESTION)
    if fmt != "chat":
        raise ValueError(f"unknown needle format {fmt!r}; choose from {', '.join(NEEDLE_FORMATS)}")
    if not getattr(tok, "chat_template", None):
        raise ValueError("needle format chat: the tokenizer has no chat template")
    turn = tok.apply_chat_template([{"role": "user", "content": CHAT_USER}], tokenize=False,
                                   add_generation_prompt=True)
    head, tail = (turn + CHAT_ANSWER).split(HAYSTACK)
    return encode(tok, head), encode(tok, tail)


def needle_prompts(tok, fmt: str, prefix: list[int], hay: list[int], lengths: list[int], depths: list[int], n: int,
                   seed: int = 0) -> list[dict]:
    """n prompts of format fmt per (length, depth %) cell, each exactly `length` ids: a fresh key, a random stretch
    of the haystack with the needle at its depth into it ("at": where the needle starts)."""
    from reference_lm import passkey

    head, tail = needle_pieces(tok, fmt, prefix)
    rng = random.Random(seed)
    cells = []
    for length in lengths:
        for depth in depths:
            for key in rng.sample(range(*passkey.KEY_RANGE), n):
                needle = encode(tok, passkey.needle(key))
                fill = length - len(head) - len(needle) - len(tail)
                if fill < 0 or fill >= len(hay):
                    raise ValueError(f"a needle prompt of {length} tokens needs 0 to {len(hay)} haystack tokens")
                start, cut = rng.randrange(len(hay) - fill), round(depth / 100 * fill)
                stretch = hay[start:start + fill]
                cells.append({"length": length, "depth": depth, "key": key, "at": len(head) + cut,
                              "ids": head + stretch[:cut] + needle + stretch[cut:] + tail})
    return cells


def answer_matches(text: str, key: int) -> bool:
    """The key, after optional white space, not followed by one more digit."""
    return re.match(rf"\s*{key}(?!\d)", text) is not None


def needle_grid(cells: list[dict], hits: list[bool]) -> dict:
    """Accuracy per (depth, length) cell: rows are depths, columns context lengths."""
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    acc = [[statistics.fmean(h for c, h in zip(cells, hits) if c["depth"] == d and c["length"] == n)
            for n in lengths] for d in depths]
    return {"lengths": lengths, "depths": depths, "accuracy": acc,
            "per_cell": len(cells) // (len(lengths) * len(depths))}


def needle_lengths(context: int) -> list[int]:
    """1024, 2048, ... below the context, and 125/128 of it (room for the answer): 1024,2048,4096,8000 at 8k."""
    last = context * 125 // 128
    return [n for n in (1024 << i for i in range(16)) if n < last] + [last]


def kl_prompt_range(spec: str | None, context: int) -> tuple[int, int]:
    """--kl-prompt-len LO,HI, by default a quarter to a half of the context (1024-2048 at 4k, 2048-4096 at 8k)."""
    if spec:
        lo, hi = map(int, spec.split(","))
        return lo, hi
    return context // 4, context // 2


def layer_presets(spec: str | None, num_layers: int) -> dict[str, str]:
    """--boundary-layers "LAYERS=PRESET[;LAYERS=PRESET]" -> {LAYERS: PRESET}, read and checked by the plugin's own
    parser; by default the first and last two layers in bf16, as vLLM's in-tree turboquant_* keep them."""
    edges = ",".join(map(str, sorted({0, 1, num_layers - 2, num_layers - 1} & set(range(num_layers)))))
    parsed = parse_layer_presets(spec or f"{edges}=bf16", "--boundary-layers")
    parsed.resolve(num_layers)
    return {layers: preset for layers, _, preset in parsed.entries}


def calibration_files(spec: str | None, chosen: list[str]) -> dict[str, str]:
    """--key-calibration: FILE for every -cal row chosen, or ROW=FILE,ROW=FILE (absolute paths)."""
    if not spec:
        return {}
    pairs = [p.split("=", 1) for p in spec.split(",")] if "=" in spec else [
        [kv, spec] for kv in chosen if KV[kv].calibrated]
    bad = [kv for kv, _ in pairs if kv not in KV or not KV[kv].calibrated]
    if bad:
        raise ValueError(f"--key-calibration names rows without {CALIBRATED}: {bad}")
    return {kv: str(Path(f).resolve()) for kv, f in pairs}


def book_body(text: str) -> str:
    """A Project Gutenberg book's text between its START and END lines (the licence cut off); other text whole."""
    text = text.replace("\r\n", "\n")
    start = re.search(r"^\*\*\* ?START OF.*$", text, re.MULTILINE)
    end = re.search(r"^\*\*\* ?END OF", text, re.MULTILINE)
    return text[start.end() if start else 0:end.start() if end else len(text)].strip()


def text_files(paths: list[str]) -> list[Path]:
    """Files as given, folders' *.txt files (sorted)."""
    missing = [p for p in paths if not Path(p).exists()]
    files = [f for p in map(Path, paths) for f in (sorted(p.rglob("*.txt")) if p.is_dir() else [p])]
    if missing or not files:
        raise ValueError(f"no text in {missing or paths}")
    return files


def read_texts(paths: list[str]) -> str:
    """The text files' (text_files) text joined by blank lines; books cut to their body."""
    return "\n\n".join(book_body(f.read_text(encoding="utf-8", errors="replace")) for f in text_files(paths))


def bytes_formula(kv: str, num_layers: int, head_dim: int, presets_by_layer: dict[str, str] | None = None) -> float:
    """K+V bytes per token per KV head, averaged over layers, from each cache's definition."""
    cache = KV[kv]
    if kv in ("bf16", "fp8"):
        return 2 * head_dim * (2 if kv == "bf16" else 1)
    if cache.preset is None:  # vLLM's own page arithmetic
        slot = common.vllm_bytes_per_token_per_head(kv, head_dim)
        if not kv.startswith("turboquant_"):
            return slot
        # vLLM keeps the in-tree turboquant's boundary layers in bf16 (engine/arg_utils.py create_engine_config)
        from types import SimpleNamespace

        from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

        model = SimpleNamespace(is_hybrid=False, hf_text_config=SimpleNamespace(num_hidden_layers=num_layers))
        skipped = len(TurboQuantConfig.get_boundary_skip_layers(model))
        return (skipped * 4 * head_dim + (num_layers - skipped) * slot) / num_layers
    per_layer = [get_preset(cache.preset).bytes_per_token_per_head(head_dim)] * num_layers
    if cache.boundary and presets_by_layer:
        entries = ";".join(f"{layers}={preset}" for layers, preset in presets_by_layer.items())
        for i, preset in parse_layer_presets(entries, "--boundary-layers").resolve(num_layers).items():
            per_layer[i] = 4 * head_dim if preset == "bf16" else get_preset(preset).bytes_per_token_per_head(head_dim)
    return statistics.fmean(per_layer)


def engine_args(kv: str, inp: dict) -> dict:
    """LLM(...) of a row: one engine for every KV cache but its cache, a fixed KV budget, chunked prefill."""
    cache = KV[kv]
    args = {"model": inp["model"], "skip_tokenizer_init": True, "max_model_len": inp["context"] + 1, "seed": 0,
            "enable_prefix_caching": False, "enable_chunked_prefill": True,
            "long_prefill_token_threshold": inp["prefill_chunk"], "max_num_seqs": MAX_SEQS,
            "max_num_batched_tokens": MAX_SEQS * inp["prefill_chunk"],  # every running sequence gets its chunk
            "kv_cache_memory_bytes": int(inp["kv_cache_gib"] * GIB), "gpu_memory_utilization": STARTUP_CHECK,
            "kv_cache_dtype": cache.dtype}
    if inp["cuda_graphs"]:  # decode graphs only: no torch.compile, whose cache each KV cache would miss
        args["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    else:
        args["enforce_eager"] = True
    if cache.backend:
        args["attention_config"] = {"backend": cache.backend}
    if cache.boundary:
        args["additional_config"] = {LAYER_PRESETS: inp["layer_presets"]}
    return args


def child_env(name: str, calibration: dict[str, str]) -> dict[str, str]:
    """What a job's child adds to the environment: ours' preset and key calibration file."""
    if name == CALIBRATION:
        return {"TURBOQUANT_PRESET": CALIBRATION_PRESET}
    cache, env = KV[name], {}
    if cache.preset:
        env["TURBOQUANT_PRESET"] = cache.preset
    if cache.calibrated:
        env["TURBOQUANT_KEY_CALIBRATION"] = calibration[name]
    return env


def job_tokens(inp: dict, formats: int = 1) -> int:
    """Prompt and generated tokens one KV cache's engine runs: its PPL windows, KL sequences and needle prompts of
    `formats` formats (bf16 runs all of them, the others one)."""
    needles = sum(len(c["ids"]) + NEEDLE_TOKENS for cells in list(inp["needles"].values())[:formats] for c in cells)
    kl = sum(len(p) + inp["kl_tokens"] for p in inp["kl_prompts"])
    return sum(map(len, inp["wikitext2"] + inp["heldout"])) + kl + needles


def expected_seconds(tokens: int, jobs: int, parallel: int, in_tree: bool) -> float:
    """Rough wall time of a run's `tokens` in all (the time model above): the imports side by side, the engines
    `parallel` at a time, their tokens at `parallel` times one engine's rate."""
    return (IMPORT_SECONDS + math.ceil(jobs / parallel) * ENGINE_SECONDS + tokens / (parallel * TOKENS_PER_SECOND)
            + (IN_TREE_COMPILE_SECONDS if in_tree else 0))


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both x and y (lower is better), by x."""
    front = [i for i, (x, y) in enumerate(points)
             if not any(a <= x and b <= y and (a, b) != (x, y) for a, b in points)]
    return sorted(front, key=lambda i: points[i])


def row_bytes(row: dict) -> float:
    """bytes_per_token_per_head (rows written before it was named so: bytes_per_token)."""
    return row.get("bytes_per_token_per_head", row.get("bytes_per_token"))


def targets(rows: list[dict]) -> list[tuple[str, bool | None, str]]:
    """The quality targets: (target, passed or None where a figure is missing, the numbers). A preset's targets hold
    for each of its rows measured, with and without a key calibration (the same format); a row that failed part way
    keeps what it measured before (an in-tree row cut off in its needle run still has its perplexity)."""
    ok = {r["kv"]: r for r in rows}
    base = ok.get("bf16", {})

    def delta(kv: str) -> float | None:
        d = ppl_delta(ok[kv], base) if kv in ok else None
        return None if d is None else d[0]

    def pct(x: float | None) -> str:
        return "missing" if x is None else f"{x:+.2f}%"

    def variants(preset: str) -> list[str]:
        return [preset] + [kv for kv in (preset + CALIBRATED,) if kv in ok]

    out = []
    for preset, limit, rival in (("tq4", 1.0, "turboquant_4bit_nc"), ("tq3", 3.0, "turboquant_3bit_nc")):
        for kv in variants(preset):
            mine, theirs = delta(kv), delta(rival)
            out.append((f"{kv}: PPL ≤ +{limit:g}% vs bf16 and below {rival}",
                        None if mine is None or theirs is None else mine <= limit and mine < theirs,
                        f"{kv} {pct(mine)}, {rival} {pct(theirs)}"))
    needle = base.get("needle_accuracy")
    ours = {kv: r["needle_accuracy"] for kv, r in ok.items()
            if kv in KV and KV[kv].preset and r.get("needle_accuracy") is not None}
    below = [f"{kv} {acc:.3f}" for kv, acc in ours.items() if needle is not None and acc < needle]
    out.append(("needle: every row of ours ≥ bf16's", None if needle is None or not ours else not below,
                "missing" if needle is None else f"bf16 {needle:.3f}; "
                + (f"below it: {', '.join(below)}" if below else f"{len(ours)} rows of ours at least as high")))
    fp8 = ok.get("fp8", {}).get("kl_vs_bf16")
    for kv in variants("tq4"):
        kl = ok.get(kv, {}).get("kl_vs_bf16")
        out.append((f"{kv}: KL ≤ 2x fp8's", None if kl is None or fp8 is None else kl <= 2 * fp8,
                    "missing" if kl is None or fp8 is None else f"{kv} {kl:.3g}, fp8 {fp8:.3g} ({kl / fp8:.2f}x)"))
    for kv in variants("tq4"):
        edge = kv + BOUNDARY
        if kv != "tq4" and edge not in ok:
            continue
        grown = row_bytes(ok[edge]) / row_bytes(ok[kv]) if edge in ok and kv in ok else None
        out.append((f"{edge}: PPL ≤ +0.5% at ≤ 1.25x tq4's bytes",
                    None if grown is None or delta(edge) is None else delta(edge) <= 0.5 and grown <= 1.25,
                    "missing" if grown is None else f"{pct(delta(edge))} at {grown:.2f}x tq4's bytes "
                    f"({row_bytes(ok[edge]):.1f} vs {row_bytes(ok[kv]):.1f} B)"))
    return out


# ---- inputs: tokenized once, by the parent ------------------------------------------------

def prepare(args) -> dict:
    """Every prompt of the run as token ids, so the engines need no tokenizer."""
    import numpy as np
    from transformers import AutoTokenizer

    cfg = json.loads((Path(args.model) / "config.json").read_text())
    context, num_layers = cfg["max_position_embeddings"], cfg["num_hidden_layers"]
    tok = AutoTokenizer.from_pretrained(args.model)
    prefix = bos_prefix(tok)
    wiki = encode(tok, Path(args.wikitext).read_text()) if args.wikitext else []
    held = np.fromfile(args.heldout, np.uint16).tolist() if args.heldout else []
    heads = cfg["num_attention_heads"]
    inp = {"model": str(Path(args.model).resolve()), "context": context, "prefix": prefix,
           "scored_from": max(1, len(prefix)), "num_layers": num_layers, "num_attention_heads": heads,
           "num_kv_heads": cfg.get("num_key_value_heads", heads), "head_dim": cfg.get("head_dim") or
           cfg["hidden_size"] // heads, "architecture": (cfg.get("architectures") or ["?"])[0],
           "vocab_size": cfg.get("vocab_size"), "kv_cache_gib": args.kv_cache_gib, "kl_tokens": args.kl_tokens,
           "prefill_chunk": args.prefill_chunk, "cuda_graphs": args.cuda_graphs,
           "layer_presets": layer_presets(args.boundary_layers, num_layers)}
    inp["wikitext2"] = windows(wiki, context, prefix)[:args.wikitext_windows or None]
    inp["heldout"] = windows(held[:args.heldout_windows * context], context, prefix)[:args.heldout_windows]

    lo, hi = kl_prompt_range(args.kl_prompt_len, context)
    assert hi + args.kl_tokens <= context, "KL prompt + continuation must fit the context"
    source = held or (encode(tok, read_texts(args.kl_text)) if args.kl_text else [])
    assert source or not args.kl_prompts, "the KL prompts come from --kl-text or --heldout (text no PPL scores)"
    rng = random.Random(0)
    inp["kl_prompts"] = []
    for _ in range(args.kl_prompts if source else 0):
        n = rng.randint(lo, hi) - len(prefix)
        start = rng.randrange(len(source) - n)
        inp["kl_prompts"].append(prefix + source[start:start + n])

    inp["needles"] = {}
    if args.haystack:
        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else needle_lengths(context)
        depths = [int(x) for x in args.depths.split(",")]
        assert max(lengths) + NEEDLE_TOKENS <= context, "a needle prompt needs room for its answer"
        essays = encode(tok, "\n\n".join(p.read_text() for p in sorted(Path(args.haystack).glob("*.txt"))))
        filler = encode(tok, REPEAT_FILLER * (max(lengths) // 10 + 2))  # ~25 tokens each
        inp["needles"] = {fmt: needle_prompts(tok, fmt, prefix, filler if fmt == "repeat" else essays, lengths,
                                              depths, args.needles) for fmt in args.needle_format.split(",")}
    return inp


# ---- one job, in its own process -----------------------------------------------------------

def layer_bytes(worker) -> dict[str, float]:
    """Runs on the vLLM worker: bytes per token per KV head of each layer's pages, as allocated."""
    config = worker.model_runner.kv_cache_config
    out = {}
    for group in config.kv_cache_groups:
        for name in group.layer_names:
            spec = getattr(group.kv_cache_spec, "kv_cache_specs", {}).get(name, group.kv_cache_spec)
            out[name] = spec.page_size_bytes / (spec.block_size * spec.num_kv_heads)
    return out


def from_bf16(work: Path, name: str, wait: bool) -> dict:
    """What bf16 wrote as work/name ({} without it); with `wait`, once bf16 has written it or ended (the parent
    marks that)."""
    path = work / name
    while wait and not path.exists() and not (work / BF16_ENDED).exists():
        time.sleep(0.5)
    return json.loads(path.read_text()) if path.exists() else {}


def write_whole(path: Path, doc: dict) -> None:
    """Whole or absent, for the children that wait for it."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(doc))
    part.replace(path)


def evaluate(kv: str, work: Path) -> None:
    """Every metric for one KV cache; prints the row after each one, so a crash keeps what came before."""
    from vllm import LLM, SamplingParams

    inp = json.loads((work / "inputs.json").read_text())
    t0 = time.perf_counter()
    llm = LLM(**engine_args(kv, inp))
    cache = llm.llm_engine.vllm_config.cache_config
    row = {"kv": kv, "kv_tokens": cache.kv_cache_size_tokens, "kv_cache_gib": inp["kv_cache_gib"],
           "seconds_by_step": {}}
    try:  # reads vLLM internals: if that breaks, the formula stands in and the metrics still run
        per_layer = llm.collective_rpc(layer_bytes)[0]
        by_layer = sorted(per_layer, key=lambda name: [int(d) for d in re.findall(r"\d+", name)])
        row["bytes_per_layer"] = [per_layer[name] for name in by_layer]
        row["bytes_per_token_runtime"] = statistics.fmean(row["bytes_per_layer"])
    except Exception as e:  # noqa: BLE001
        row["bytes_runtime_error"] = repr(e)

    def emit(step: str, t: float) -> None:
        row["seconds_by_step"][step] = time.perf_counter() - t
        print(ROW_TAG + json.dumps(row), flush=True)

    def score(seqs: list[list[int]], starts: list[int]) -> list[list[float]]:
        """Log-prob of each token from its sequence's start index on, given the tokens before it."""
        outs = llm.generate([{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=0),
                            use_tqdm=False)
        return [[o.prompt_logprobs[t][s[t]].logprob for t in range(b, len(s))] for o, s, b in zip(outs, seqs, starts)]

    def ppl(name: str) -> None:
        logprobs = score(inp[name], [inp["scored_from"]] * len(inp[name]))
        row[f"ppl_{name}"], row[f"{name}_tokens"] = perplexity(logprobs)
        row[f"{name}_window_nll"] = [-statistics.fmean(x) for x in logprobs]  # for the paired error of a change

    def kl() -> None:
        prompts = inp["kl_prompts"]
        if kv == "bf16":
            params = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=inp["kl_tokens"], ignore_eos=True, seed=i)
                      for i in range(len(prompts))]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
            starts = [len(p) for p in prompts]
            write_whole(work / KL_REFERENCE, {"model": inp["model"], "prompts": prompts, "sequences": seqs,
                                               "starts": starts, "logprobs": score(seqs, starts)})
        ref = from_bf16(work, KL_REFERENCE, inp["bf16_pending"])
        if ref.get("model") == inp["model"] and ref.get("prompts") == prompts:  # not another run's reference
            mine = ref["logprobs"] if kv == "bf16" else score(ref["sequences"], ref["starts"])
            row["kl_vs_bf16"], row["kl_stderr"], row["kl_tokens"] = kl_estimate(ref["logprobs"], mine)

    def needle() -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(inp["model"])
        params = SamplingParams(temperature=0.0, max_tokens=NEEDLE_TOKENS)
        formats = list(inp["needles"])
        if kv != "bf16":  # bf16's choice; the first one listed without it
            chosen = from_bf16(work, NEEDLE_FORMAT, inp["bf16_pending"]).get("format")
            formats = [chosen if chosen in formats else formats[0]]
        found = {}
        for fmt in formats:
            cells = inp["needles"][fmt]
            outs = llm.generate([{"prompt_token_ids": c["ids"]} for c in cells], params, use_tqdm=False)
            texts = [tok.decode(o.outputs[0].token_ids) for o in outs]
            found[fmt] = (cells, texts, [answer_matches(text, c["key"]) for text, c in zip(texts, cells)])
        best = max(formats, key=lambda fmt: statistics.fmean(found[fmt][2]))  # the first one on a tie
        if kv == "bf16":
            write_whole(work / NEEDLE_FORMAT, {"format": best})
        cells, texts, hits = found[best]
        row.update(needle_format=best, needle_accuracy=statistics.fmean(hits), needle_grid=needle_grid(cells, hits),
                   needle_by_format={fmt: statistics.fmean(h) for fmt, (_, _, h) in found.items()},
                   needle_misses=[{"length": c["length"], "depth": c["depth"], "key": c["key"], "answer": text}
                                  for c, text, hit in zip(cells, texts, hits) if not hit][:5])

    emit("startup", t0)
    steps = {"kl": (kl, inp["kl_prompts"]), "wikitext2": (functools.partial(ppl, "wikitext2"), inp["wikitext2"]),
             "heldout": (functools.partial(ppl, "heldout"), inp["heldout"]), "needle": (needle, inp["needles"])}
    # bf16 first makes what the others wait for at their end: the KL reference, the needle format
    for step in ("kl", "needle", "wikitext2", "heldout") if kv == "bf16" else ("wikitext2", "heldout", "kl", "needle"):
        run_step, work_items = steps[step]
        if work_items:
            t = time.perf_counter()
            run_step()
            emit(step, t)


def fit_calibration(work: Path) -> None:
    """The key calibration, by turboquant-vllm calibrate's code, on the run's calibration text."""
    import vllm

    from turboquant_vllm.vllm.calibrate import calibrate

    inp = json.loads((work / "inputs.json").read_text())
    # calibrate() sizes its cache by profiling the GPU, which the other children change as they come and go
    vllm.LLM = functools.partial(vllm.LLM, kv_cache_memory_bytes=CALIBRATION_KV_GIB * GIB)
    summary = calibrate(inp["model"], [str(work / CALIBRATION_TEXT)], work / CALIBRATION_FILE,
                        max_tokens=inp["calibration_tokens"], window=inp["context"],
                        gpu_memory_utilization=STARTUP_CHECK)
    print(ROW_TAG + json.dumps(dict(kv=CALIBRATION, file=str(work / CALIBRATION_FILE), **summary)), flush=True)


def child_main(name: str, work: Path) -> None:
    """A child: imports vLLM, says READY, and starts its engine on the parent's go (a line on stdin)."""
    # the slow import, done while other children run (`import vllm` alone is lazy)
    from vllm import LLM, SamplingParams  # noqa: F401

    print(READY, flush=True)
    if not sys.stdin.readline():  # the parent is gone
        return
    if name == CALIBRATION:
        fit_calibration(work)
    else:
        evaluate(name, work)


# ---- the run: one child per job -------------------------------------------------------------

class Scheduler:
    """Who starts when: in order, at most `slots` at once, each once the jobs it needs have ended (one whose needs
    have not lets the next ones pass), nothing after the deadline (time.monotonic())."""

    def __init__(self, order: list[str], slots: int, needs: dict[str, set[str]] | None = None,
                 deadline: float = math.inf):
        self.pending, self.slots, self.needs, self.deadline = list(order), slots, needs or {}, deadline
        self.ready: set[str] = set()
        self.running: set[str] = set()
        self.ended: set[str] = set()
        self.started: list[str] = []  # in the order they started
        self.changed = threading.Condition()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def _turn(self, name: str) -> bool:
        if len(self.running) >= self.slots:
            return False
        first = next((job for job in self.pending if self.needs.get(job, set()) <= self.ended), None)
        return first == name and name in self.ready

    def start(self, name: str) -> bool:
        """Blocks until name's turn (True), or the deadline (False: it ends unstarted)."""
        with self.changed:
            self.ready.add(name)
            self.changed.notify_all()
            started = self.changed.wait_for(lambda: self._turn(name) or self.left() <= 0,
                                            None if self.deadline == math.inf else max(0.0, self.left()))
            started = started and self.left() > 0
            if started:
                self.running.add(name)
                self.started.append(name)
            self.pending.remove(name)
            self.changed.notify_all()
            return started

    def end(self, name: str) -> None:
        """name has ended (run, never started, or died before its turn)."""
        with self.changed:
            if name in self.pending:
                self.pending.remove(name)
            self.running.discard(name)
            self.ended.add(name)
            self.changed.notify_all()


def child_command(name: str, work: Path) -> list[str]:
    """python -m benchmarks.quality --child NAME (run with common.child_env: the repository root on PYTHONPATH)."""
    return common.module_command(NAME, "--child", name, "--work", str(Path(work).resolve()))


def child(name: str, work: Path, env: dict, timeout: float, scheduler: Scheduler) -> tuple[str, str, int, float]:
    """One job's process: its stdout, stderr, exit code and seconds from its go. It starts at once (its imports);
    its engine on its turn. Afterwards its whole session is killed, so no engine process keeps GPU memory."""
    stdout, stderr, ready = [], [], threading.Event()

    def read(stream, lines: list[str]) -> None:  # as it comes: READY must be seen while the child runs
        with stream:
            for line in stream:
                lines.append(line)
                if line.startswith(READY):
                    ready.set()

    proc = subprocess.Popen(child_command(name, work), env=common.child_env(env), text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    readers = [threading.Thread(target=read, args=(proc.stdout, stdout)),
               threading.Thread(target=read, args=(proc.stderr, stderr))]
    for reader in readers:
        reader.start()
    while not ready.wait(0.1) and proc.poll() is None and scheduler.left() > 0:
        pass
    t0, note = time.perf_counter(), ""
    if ready.is_set() and proc.poll() is None and scheduler.start(name):
        t0 = time.perf_counter()
        limit = min(timeout or math.inf, scheduler.left())
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.write("go\n")
            proc.stdin.flush()
        try:
            proc.wait(None if limit == math.inf else limit)
        except subprocess.TimeoutExpired:
            note = f"\nTimeoutError: killed after {limit:.0f} s"
    elif proc.poll() is None:
        note = "\nTimeoutError: not started within --time-budget"
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for reader in readers:  # the session is gone: every pipe is at its end
        reader.join()
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.close()
    scheduler.end(name)
    return "".join(stdout), "".join(stderr) + note, proc.returncode, time.perf_counter() - t0


def default_out(model: str) -> Path:
    return common.RESULTS / NAME / f"{Path(model).name}.json"


def run(args) -> None:
    t_start = time.monotonic()
    out, work = Path(args.out or default_out(args.model)), Path(args.work)
    out.parent.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    chosen = args.kv.split(",")
    unknown = set(chosen) - set(KV)
    assert not unknown, f"unknown KV caches {unknown}; choose from {', '.join(KV)}"
    assert args.parallel >= 1, "--parallel must be at least 1"
    calibration = calibration_files(args.key_calibration, chosen)
    fit = [kv for kv in KV if kv in chosen and KV[kv].calibrated and kv not in calibration]
    assert not fit or args.calibration_text, f"{fit} need --key-calibration or --calibration-text"
    inp = prepare(args)
    inp["bf16_pending"] = "bf16" in chosen
    if "bf16" in chosen:  # what an earlier call's bf16 wrote must not stand in for this one's
        for stale in (KL_REFERENCE, NEEDLE_FORMAT, BF16_ENDED):
            (work / stale).unlink(missing_ok=True)
    if fit:
        (work / CALIBRATION_TEXT).write_text(read_texts(args.calibration_text))
        inp["calibration_tokens"] = args.calibration_tokens
        calibration.update(dict.fromkeys(fit, str((work / CALIBRATION_FILE).resolve())))
    (work / "inputs.json").write_text(json.dumps(inp))
    # bf16 first (the others' KL waits for it), the calibration next, the rows that need it last
    order = ["bf16"] * ("bf16" in chosen) + [CALIBRATION] * bool(fit) + [
        kv for kv in KV if kv in chosen and kv != "bf16" and kv not in fit] + fit
    tokens = job_tokens(inp)
    total = sum(job_tokens(inp, len(inp["needles"]) if kv == "bf16" else 1) for kv in chosen) + (
        args.calibration_tokens if fit else 0)
    expected = expected_seconds(total, len(order), args.parallel, any(kv in IN_TREE for kv in chosen))
    print(f"{len(order)} jobs ({', '.join(order)}), {args.parallel} at once with {args.kv_cache_gib:g} GiB of KV "
          f"cache each, {tokens:,} tokens per KV cache: expected ~{expected:.0f} s"
          + (f" (time budget {args.time_budget:.0f} s)" if args.time_budget else ""), flush=True)

    command = common.command_line(NAME, getattr(args, "argv", None))
    provenance = common.provenance(command)
    doc = {"model": Path(args.model).name, "rows": [], "commands": []}
    if args.merge and out.exists():  # keep the other KV caches' rows of an earlier call
        doc = json.loads(out.read_text())
        doc.pop("meta", None)  # this call's provenance replaces the earlier one's; merged rows keep their command
        doc["rows"] = [r for r in doc["rows"] if r["kv"] not in chosen]
    doc["commands"].append(command)
    model_keys = ("context", "num_layers", "head_dim", "num_attention_heads", "num_kv_heads", "architecture",
                  "vocab_size")
    doc.update(vllm=metadata.version("vllm"), device=provenance["gpu"], work=str(work), settings={
        **{k: inp[k] for k in model_keys}, "bos": bool(inp["prefix"]), "wikitext2_windows": len(inp["wikitext2"]),
        "heldout_windows": len(inp["heldout"]), "kl_prompts": len(inp["kl_prompts"]),
        "kl_prompt_len": "-".join(map(str, kl_prompt_range(args.kl_prompt_len, inp["context"]))),
        "kl_tokens": args.kl_tokens,
        "kl_text": ["held-out ids"] if args.heldout else [f.name for f in text_files(args.kl_text)] if args.kl_text
        else [],
        "needle_lengths": ",".join(map(str, sorted({c["length"] for cells in inp["needles"].values() for c in cells}))),
        "needle_depths": args.depths, "needles_per_cell": args.needles, "needle_formats": list(inp["needles"]),
        "prefill_chunk": args.prefill_chunk, "kv_cache_gib": args.kv_cache_gib, "parallel": args.parallel,
        "cuda_graphs": args.cuda_graphs, "boundary_layers": inp["layer_presets"], "tokens_per_kv_cache": tokens,
        "expected_seconds": round(expected), "prepare_seconds": time.monotonic() - t_start})
    if args.key_calibration:
        doc["key_calibration"] = args.key_calibration
    log = children_log(out, provenance["gpu"])
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    deadline = t_start + args.time_budget if args.time_budget else math.inf
    scheduler = Scheduler(order, args.parallel, {key: {CALIBRATION} for key in fit}, deadline)

    def measure(name: str) -> tuple[str, str, str, int, float]:
        # max_model_len = context + 1 (see the docstring); collective_rpc ships layer_bytes (a function) to the worker
        env = dict(os.environ, VLLM_ALLOW_LONG_MAX_MODEL_LEN="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
                   **child_env(name, calibration))
        result = child(name, work, env, args.child_timeout, scheduler)
        if name == "bf16":  # the children waiting for its KL reference stop waiting
            (work / BF16_ENDED).touch()
        return name, *result

    def record(name: str, stdout: str, stderr: str, rc: int, seconds: float) -> None:
        with log.open("a") as f:
            f.write(f"==== {name} (rc {rc})\n{stdout[-20000:]}\n{stderr[-20000:]}\n")
        found = [line[len(ROW_TAG):] for line in stdout.splitlines() if line.startswith(ROW_TAG)]
        row = json.loads(found[-1]) if found else {"kv": name}
        complete = all(key in row for key in ("ppl_wikitext2", "needle_accuracy", "kl_vs_bf16"))
        if rc and complete:  # every figure is in: a crash while the engine tears down costs nothing measured
            row["exit"] = (stderr.strip().splitlines() or [f"exit code {rc}"])[-1]
        elif rc or not found:
            row["error"] = "\n".join(stderr.strip().splitlines()[-12:]) or f"exit code {rc}"
        row["seconds"] = seconds
        if name == CALIBRATION:
            doc["calibration_fit"] = dict(row, text=[f.name for f in text_files(args.calibration_text)],
                                          preset=CALIBRATION_PRESET)
        else:
            row["bytes_per_token_formula"] = bytes_formula(name, inp["num_layers"], inp["head_dim"],
                                                           inp["layer_presets"])
            row["bytes_per_token_per_head"] = row.get("bytes_per_token_runtime", row["bytes_per_token_formula"])
            if name in calibration:
                row["key_calibration"] = calibration[name]
            row["command"] = command  # rows merged from other calls keep theirs
            doc["rows"] = sorted(doc["rows"] + [row], key=lambda r: list(KV).index(r["kv"]))
        doc["settings"].update(wall_seconds=time.monotonic() - t_start, start_order=scheduler.started)
        common.write_json(out, doc, provenance)  # after every job: a cut-off run keeps what it measured
        print(f"{name}: {row.get('error', 'ok').splitlines()[-1]} ({seconds:.0f} s, "
              f"{time.monotonic() - t_start:.0f} s into the run)", flush=True)

    with ThreadPoolExecutor(len(order)) as pool:  # every child at once: they import side by side
        for done in as_completed([pool.submit(measure, name) for name in order]):
            record(*done.result())
    text = markdown(doc)
    common.write_markdown(common.with_ext(common.stem_of(out), ".md"), text, provenance)
    print(text)


# ---- the report: markdown and figures, rendered locally -------------------------------------

def children_log(out: Path, gpu: str | None) -> Path:
    """The children's output: <folder of out's name>/<gpu>-children.log (results/quality/smollm2-135m/h100-...)."""
    return common.stem_of(out) / f"{common.gpu_tag(gpu)}-children.log"


def _pct(x, base) -> str:
    return "" if x is None else f"{x:.3f}" + (f" ({(x / base - 1) * 100:+.2f}%)" if base else "")


def _delta(row: dict, base: dict) -> str:
    d = ppl_delta(row, base)
    if d is None:
        return ""
    return f"{d[0]:+.2f}%" + ("" if d[1] is None else f" ± {d[1]:.2f}")


def _model_line(doc: dict) -> str:
    s = doc.get("settings", {})
    shape = (f" ({s['architecture']}: {s['num_layers']} layers, {s['num_attention_heads']} query / "
             f"{s['num_kv_heads']} KV heads of dim {s['head_dim']}, vocabulary {s['vocab_size']})"
             if s.get("num_kv_heads") else "")
    return (f"Model `{doc['model']}`{shape}, vLLM {doc.get('vllm') or '?'}, {doc.get('device') or '?'}; "
            f"context {s.get('context')}.")


def markdown(doc: dict) -> str:
    rows = doc["rows"]
    base = next((r for r in rows if r["kv"] == "bf16"), {})  # what a cut-off bf16 run measured still holds
    held = any(r.get("ppl_heldout") is not None for r in rows)
    lines = [f"## {doc['model']}: KV cache quality in vLLM", "",
             "| kv | bytes/token/head | KV tokens | PPL WikiText-2 | Δ PPL vs bf16 |" + (" PPL held-out |" * held)
             + " needle | KL vs bf16 (nats/token) | s |", "| --- " * (8 + held) + "|"]
    for r in rows:
        kl = "" if r.get("kl_vs_bf16") is None else f"{r['kl_vs_bf16']:.3g} ± {r['kl_stderr']:.2g}"
        needle = "" if r.get("needle_accuracy") is None else f"{r['needle_accuracy']:.3f}"
        ppl = "" if r.get("ppl_wikitext2") is None else f"{r['ppl_wikitext2']:.3f}"
        lines.append(f"| {r['kv']}{' (failed)' if 'error' in r else ''} | {row_bytes(r):.1f} | "
                     f"{format(r['kv_tokens'], ',') if 'kv_tokens' in r else ''} | {ppl} | {_delta(r, base)} |"
                     + (f" {_pct(r.get('ppl_heldout'), base.get('ppl_heldout'))} |" if held else "")
                     + f" {needle} | {kl} | {r.get('seconds', 0):.0f} |")
    checks = targets(rows)
    if any(passed is not None for _, passed, _ in checks):
        lines += ["", "| target | result | measured |", "| --- | --- | --- |"]
        lines += [f"| {t} | {'n/a' if p is None else 'PASS' if p else 'FAIL'} | {m} |" for t, p, m in checks]
    s = doc.get("settings", {})
    if s.get("kv_cache_gib"):
        shared = [(f"Every engine has a KV cache of {s['kv_cache_gib']:g} GiB (KV tokens: this cache's tokens that "
                   f"fit in it); {s['parallel']} engines ran at once on the one GPU, so their seconds overlap.")]
    elif s.get("parallel", 1) > 1:
        shared = [(f"The KV caches after bf16 ran {s['parallel']} at once on the one GPU, each with "
                   f"gpu_memory_utilization {s['parallel_gpu_memory_utilization']:.3g} (bf16: "
                   f"{s['gpu_memory_utilization']}): their KV tokens reflect that smaller share, and their seconds "
                   "overlap.")]
    else:
        shared = []
    calls: dict[str, list[str]] = {}  # rows merged (--merge) from other calls name the call that measured them
    for r in rows:
        calls.setdefault(r.get("command", "unrecorded"), []).append(r["kv"])
    measured = [f"Measured by `{cmd}`: {', '.join(kvs)}." for cmd, kvs in calls.items()] if len(calls) > 1 else []
    windows_note = f"{s.get('wikitext2_windows')} WikiText-2" + (
        f" / {s.get('heldout_windows')} held-out" if held else "")
    kl_text = s.get("kl_text") or ["held-out ids"]
    notes = [
        _model_line(doc),
        (f"PPL: {windows_note} windows of the full context{', BOS first' if s.get('bos') else ''}, the first token "
         f"of each window not scored, prefill in chunks of {s.get('prefill_chunk')} tokens (so the in-tree "
         "turboquant_* read their compressed cache); Δ vs bf16 ± its standard error over the windows (paired)."),
        (f"Needle: lengths {s.get('needle_lengths')}, depths {s.get('needle_depths')} %, "
         f"{s.get('needles_per_cell')} keys per cell, format {base.get('needle_format', 'passkey')}"
         + (f" (bf16's best of {', '.join(f'{f} {a:.3f}' for f, a in base['needle_by_format'].items())})"
            if len(base.get("needle_by_format", {})) > 1 else "") + ", greedy, the exact key."),
        (f"KL: {s.get('kl_prompts')} prompts of {s.get('kl_prompt_len')} tokens from "
         f"{', '.join(kl_text)} (no PPL scores that text) + "
         f"{s.get('kl_tokens')} tokens sampled by bf16 (T = 1); mean of log P_bf16 - log Q over the sampled tokens "
         "± standard error."),
        ("bytes/token/head: K+V per token per KV head, averaged over layers as vLLM allocates the pages; "
         "the in-tree turboquant_* keep the first and last 2 layers in bf16."),
        ANCHORS,
        *shared,
        *measured,
    ]
    if base.get("needle_accuracy") is not None and base["needle_accuracy"] < 0.95:
        notes.append(f"bf16 finds only {base['needle_accuracy']:.3f} of the keys: the needle measures the model as "
                     "much as its cache here.")
    if s.get("boundary_layers") and any(KV.get(r["kv"], Cache(None)).boundary for r in rows):
        notes.append(f"*{BOUNDARY}: --additional-config {LAYER_PRESETS} = `{json.dumps(s['boundary_layers'])}`.")
    fit = doc.get("calibration_fit")
    if doc.get("key_calibration"):
        notes.append(f"*{CALIBRATED}: the same preset with the key calibration `{doc['key_calibration']}` "
                     "(core.calibration: keys cached as (k - mean) / scale, queries times scale; no bytes per token).")
    if fit:
        notes.append(f"*{CALIBRATED}: the same preset with a key calibration fitted in this run ({fit.get('tokens')} "
                     f"tokens of {', '.join(fit['text'])} in windows of {fit.get('window')}, {fit['preset']}'s cache)."
                     if "error" not in fit else f"the key calibration failed: `{fit['error'].splitlines()[-1]}`")
    notes += [f"{r['kv']} failed: `{r['error'].splitlines()[-1]}`" for r in rows if "error" in r]
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n\n" + common.not_on_hopper_markdown()


def _family(kv: str) -> str:
    return "in-tree TurboQuant" if kv.startswith("turboquant_") else "baseline" if kv in ("bf16", "fp8") else "ours"


def plot(doc: dict, figure: Path, needles: Path) -> None:
    """figure: quality vs bytes; needles.png and needles/<kv>.png: the needle heatmaps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if row_bytes(r) is not None]
    base = next((r for r in rows if r["kv"] == "bf16"), {})
    panels = [(f"ppl_{n}", f"PPL {t}, % vs bf16") for n, t in (("wikitext2", "WikiText-2"), ("heldout", "held-out"))
              if base.get(f"ppl_{n}")] + [("kl_vs_bf16", "KL vs bf16 (nats/token)")]
    colors = {"baseline": "gray", "in-tree TurboQuant": "tab:orange", "ours": "tab:blue"}
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        pts = [(row_bytes(r), r[key] if key == "kl_vs_bf16" else (r[key] / base[key] - 1) * 100, r["kv"])
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
    fig.savefig(figure, dpi=120)
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


def report(path: Path, out: Path | None = None) -> str:
    """The markdown of the result file at path, printed; with out, also written to out.md and out.png, and
    out/needle.png and out/needle/<kv>.png. The result file itself is only read."""
    doc = json.loads(path.read_text())
    text = markdown(doc)
    if doc.get("meta"):  # a file from before the provenance was recorded renders without its header
        text = common.markdown_header(doc["meta"]) + text
    print(text, end="")
    if out is not None:
        stem = common.stem_of(out)
        md = common.with_ext(stem, ".md")
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(text)
        plot(doc, common.with_ext(stem, ".png"), stem / "needle")
    return text


def parser() -> argparse.ArgumentParser:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--model", help="HF model directory (config.json, safetensors, tokenizer)")
    ap.add_argument("--wikitext", help="WikiText-2 test split, raw text")
    ap.add_argument("--heldout", help="held-out token file: flat uint16 ids (val.bin); also the KL prompts' text")
    ap.add_argument("--kl-text", nargs="+", metavar="PATH",
                    help="the KL prompts' text without --heldout, text no PPL scores: files or folders of *.txt "
                    "(Project Gutenberg books are cut to their body)")
    ap.add_argument("--haystack", help="folder of Paul Graham essays (*.txt)")
    ap.add_argument("--kv", default=",".join(DEFAULT_KV),
                    help=f"rows: bf16, fp8, {', '.join(IN_TREE)}, PRESET[{CALIBRATED}][{BOUNDARY}] "
                    f"(PRESET: {', '.join(PRESETS)})")
    ap.add_argument("--key-calibration", metavar="FILE|ROW=FILE,...",
                    help=f"key calibration file of every *{CALIBRATED} row, or one per row (turboquant-vllm calibrate)")
    ap.add_argument("--calibration-text", nargs="+", metavar="PATH",
                    help=f"fit the key calibration of the *{CALIBRATED} rows without a --key-calibration file in this "
                    "run, on this text (files or folders of *.txt; never text the benchmark scores)")
    ap.add_argument("--calibration-tokens", type=int, default=262_144, help="tokens of --calibration-text to fit on")
    ap.add_argument("--boundary-layers", metavar="LAYERS=PRESET[;LAYERS=PRESET]",
                    help=f"the *{BOUNDARY} rows' --additional-config {LAYER_PRESETS} (default: the first and last "
                    "two layers in bf16, 0,1,28,29=bf16 for 30 layers)")
    ap.add_argument("--wikitext-windows", type=int, default=0, help="score only the first N windows (0: all)")
    ap.add_argument("--heldout-windows", type=int, default=32)
    ap.add_argument("--kl-prompts", type=int, default=32)
    ap.add_argument("--kl-prompt-len", help="LO,HI: prompt lengths drawn uniformly (default: a quarter to a half "
                    "of the context)")
    ap.add_argument("--kl-tokens", type=int, default=512, help="tokens bf16 samples after each prompt")
    ap.add_argument("--lengths", help="needle context lengths (default: 1024, 2048, ... and 125/128 of the "
                    "context: 1024,2048,4096,8000 at 8k)")
    ap.add_argument("--depths", default="0,25,50,75,100", help="needle depths, percent")
    ap.add_argument("--needles", type=int, default=10, help="keys per (length, depth) cell")
    ap.add_argument("--needle-format", default="passkey,repeat",
                    help=f"candidate prompt formats, comma-separated ({', '.join(NEEDLE_FORMATS)}): bf16 keeps the one "
                    "it answers best, the others run that one")
    ap.add_argument("--prefill-chunk", type=int, default=64,
                    help="prefill tokens per sequence and step, <= 128 (see the docstring)")
    ap.add_argument("--kv-cache-gib", type=float, default=12, help="KV cache of every engine, GiB")
    ap.add_argument("--parallel", type=int, default=4, metavar="N", help="engines at once on the GPU")
    ap.add_argument("--cuda-graphs", action="store_true", help="decode CUDA graphs (FULL_DECODE_ONLY, no compile)")
    ap.add_argument("--time-budget", type=float, default=0,
                    help="seconds for the whole run: then running children are killed, no more start (0: none)")
    ap.add_argument("--out", help="the results' JSON (default: benchmarks/results/quality/<model folder>.json); "
                    "with --report: where to write the rendered PATH.md / .png (default: print only)")
    ap.add_argument("--work", default="/tmp/turboquant_quality",
                    help="inputs, bf16's KL reference, the fitted calibration; keep it across --merge calls")
    ap.add_argument("--merge", action="store_true", help="keep rows of other KV caches already in --out")
    ap.add_argument("--child-timeout", type=float, default=0, help="seconds per KV cache before it is killed (0: none)")
    ap.add_argument("--report", metavar="JSON", help="print the table of a result file (no GPU); it is only read")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.argv = argv
    if args.report:
        report(Path(args.report), Path(args.out) if args.out else None)
    elif args.child:
        child_main(args.child, Path(args.work))
    else:
        assert args.model, "--model is required"
        run(args)


if __name__ == "__main__":
    main()
