"""A soak of `vllm serve` under vLLM's own `vllm bench serve`, for tq4, tq3 and FLASH_ATTN bf16 in one run: latency
percentiles and throughput per KV cache, preemption on (GPU; the converted SmolLM2-135M-Instruct).

Each KV cache in turn (--kv, default tq4,tq3,bf16): `vllm serve MODEL --attention-backend CUSTOM` (TURBOQUANT_PRESET
tq4 / tq3), `--attention-backend FLASH_ATTN` (bf16) or one of vLLM's compressed caches that run on Hopper
(--kv-cache-dtype NAME, the row's name; common.VLLM_KV), on 127.0.0.1 (serving_common.Server: a process group of its
own, killed whole), with a KV cache of --kv-tokens tokens for every one of them (--block-size 16
--num-gpu-blocks-override N), too few for --concurrency requests at once, so that vLLM preempts; then

    vllm bench serve --backend openai --base-url URL --endpoint /v1/completions --model MODEL
        --dataset-name sharegpt --dataset-path PROMPTS.json --num-prompts N --max-concurrency 64
        --request-rate inf --ignore-eos --temperature 0 --percentile-metrics ttft,tpot,itl,e2el
        --metric-percentiles 50,90,99 --save-result --save-detailed ...

over --requests requests of mixed lengths built from --data's real text (serving_common.soak_prompt_set: lognormal
prompt and answer lengths, as chat logs have them, written as ShareGPT JSON: the answer's token count is the output
length; vLLM skips prompts over 1,024 tokens or prompt + answer over 2,048 and repeats others to make up the count),
or vLLM's random dataset (--dataset random). Around it: the fixed greedy prompt set (serving_common.PROMPTS) before
and after the load (the same tokens), GPU memory (nvidia-smi) and /metrics (KV-cache usage, requests running /
waiting) sampled every --sample-interval seconds, vllm:num_preemptions_total counted from /metrics before and after,
the KV cache back to 0 and /health after.

A row passes with zero failed requests, at least one preemption, GPU memory flat after the warm-up (the first
--warmup-fraction of the samples; growth <= --memory-tolerance-mib), the same greedy tokens after the soak, the cache
idle after it and the server healthy.

On the GPU machine (the model converted first: turboquant-vllm model smollm2 --out DIR):
    python -m benchmarks serving_soak --model DIR [--data DIR] [--quick] [--kv tq4,tq3,bf16]
Writes benchmarks/results/serving/soak.json's "rows" (merged: other KV caches' rows and "spec_decode" kept),
benchmarks/results/serving/<gpu>-soak.{md,png} (the latency percentiles, the commands, the provenance) and
benchmarks/results/serving/<gpu>-soak/<kv>.json (vllm bench serve's JSON, the per-request lists left out).
A short soak on tq4 is a test: TURBOQUANT_SMOLLM2_DIR=DIR python -m pytest -m gpu tests/serving/test_gpu_soak.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from . import common, engine_rows
from . import serving_common as sc

NAME = "serving_soak"
# kv -> (attention backend, None: vLLM's pick; our preset; kv_cache_dtype). vLLM's compressed caches that run on Hopper
# are named by their kv_cache_dtype (common.VLLM_KV), the others a line of the report.
KV = {"tq4": ("CUSTOM", "tq4", "auto"), "tq3": ("CUSTOM", "tq3", "auto"), "bf16": ("FLASH_ATTN", None, "auto"),
      **{dtype: (backend, None, dtype) for dtype, backend in common.VLLM_KV.items()}}

BLOCK_SIZE = 16

PERCENTILES = (50, 90, 99)

LATENCIES = ("ttft", "tpot", "itl", "e2el")

PER_REQUEST = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")

# KV tokens: at least MAX_MODEL_LEN (vLLM refuses a cache that cannot hold one longest request), about half of what 64
# requests of these lengths hold at once (~1.35 tokens a word)
FULL = dict(requests=2000, kv_tokens=8192, prompt_words=(16, 640), median_prompt_words=160,
            answer_words=(8, 256), median_answer_words=48, bench_timeout=540)

QUICK = dict(requests=400, kv_tokens=6144, prompt_words=(16, 400), median_prompt_words=120,
             answer_words=(8, 96), median_answer_words=32, bench_timeout=240)

_KV_TOKENS_LOG = re.compile(r"GPU KV cache size: ([\d,]+) tokens")



# ---- arguments and commands -------------------------------------------------------------------------------------

def int_pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LO <= HI")
    return lo, hi


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = common.parser(NAME, __doc__)
    sc.add_model_and_data(ap, f"the text folder for --dataset text (default: ${sc.TEXT_DATA_ENV}, .gpukit/w2/data "
                                 f"or ../shared/data)")
    ap.add_argument("--kv", default="tq4,tq3,bf16", help=f"KV caches, comma-separated, of {sorted(KV)}")
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK['requests']} requests, answers of {QUICK['answer_words']} words, a "
                         f"{QUICK['kv_tokens']}-token KV cache: ~6 minutes on an H100 for the three KV caches "
                         f"(mostly the servers' starts)")
    ap.add_argument("--requests", type=int, help=f"requests a KV cache (default {FULL['requests']})")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--kv-tokens", type=int, help=f"KV-cache tokens every server gets (default {FULL['kv_tokens']})")
    ap.add_argument("--dataset", choices=("text", "random"), default="text",
                    help="text: mixed lengths from --data (ShareGPT JSON); random: vLLM's random dataset")
    ap.add_argument("--prompt-words", type=int_pair, help=f"LO,HI words of a text prompt (default "
                                                             f"{FULL['prompt_words']})")
    ap.add_argument("--median-prompt-words", type=int)
    ap.add_argument("--answer-words", type=int_pair, help=f"LO,HI words of a text answer: its tokens are generated "
                                                             f"(default {FULL['answer_words']})")
    ap.add_argument("--median-answer-words", type=int)
    ap.add_argument("--random-input-len", type=int, default=512, help="--dataset random's")
    ap.add_argument("--random-output-len", type=int, default=128, help="--dataset random's")
    ap.add_argument("--random-range-ratio", type=float, default=0.9, help="--dataset random's")
    ap.add_argument("--sample-interval", type=float, default=1.0, help="seconds between GPU memory / metrics samples")
    ap.add_argument("--warmup-fraction", type=float, default=0.2, help="of the samples, before memory must be flat")
    ap.add_argument("--memory-tolerance-mib", type=float, default=256.0)
    ap.add_argument("--no-greedy", action="store_true", help="skip the greedy prompt set before and after the load")
    ap.add_argument("--bench-timeout", type=float, help="seconds one `vllm bench serve` may take")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-arg", action="append", default=[], help="one more `vllm serve` argument (every server)")
    ap.add_argument("--bench-arg", action="append", default=[], help="one more `vllm bench serve` argument")
    ap.add_argument("--out", type=Path, default=common.result_stem("serving", "soak"),
                    help="the Markdown / PNG stem, vllm bench serve's JSON in the folder of that name (default: "
                         "benchmarks/results/serving/<gpu>-soak)")
    ap.add_argument("--summary", type=Path, default=sc.summary_path(),
                    help="the summary to merge rows into (default: benchmarks/results/serving/soak.json)")
    ap.add_argument("--logs", type=Path, help="servers' and benchmarks' logs (default: a temporary folder)")
    args = ap.parse_args(argv)
    sc.apply_scale(args, QUICK, FULL)
    args.kv_list = [k.strip() for k in args.kv.split(",") if k.strip()]
    bad = [k for k in args.kv_list if k not in KV]
    if bad or not args.kv_list:
        ap.error(f"unknown or no --kv: {bad}; of {sorted(KV)}")
    if args.requests < 1 or args.concurrency < 1 or args.kv_tokens < sc.MAX_MODEL_LEN:
        ap.error(f"--requests and --concurrency >= 1, --kv-tokens >= the servers' max_model_len {sc.MAX_MODEL_LEN}")
    if not 0 <= args.warmup_fraction < 1:
        ap.error("--warmup-fraction in [0, 1)")
    return args


def kv_blocks(kv_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return math.ceil(kv_tokens / block_size)


def serve_extra(args: argparse.Namespace) -> tuple[str, ...]:
    """What every soak server adds to serving_common.serve_command: the same KV-cache size for all. (vLLM may raise
    --block-size for the in-tree turboquant_*, whose bf16 boundary layers share the block pool: their row's
    served_kv_tokens then says what they held.)"""
    return ("--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(kv_blocks(args.kv_tokens)),
            *args.serve_arg)


def kv_serve_args(kv: str) -> tuple[str, ...]:
    """A KV cache's own `vllm serve` arguments beside --attention-backend: its --kv-cache-dtype."""
    dtype = KV[kv][2]
    return ("--kv-cache-dtype", dtype) if dtype != "auto" else ()


def bench_command(args: argparse.Namespace, kv: str, base_url: str, model: str, dataset: Path | None,
                  result_dir: Path) -> list[str]:
    """`vllm bench serve` (vLLM 0.33's flags) against base_url, its detailed JSON saved as result_dir/<kv>.json."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
           "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model,
           "--num-prompts", str(args.requests), "--max-concurrency", str(args.concurrency), "--request-rate", "inf",
           "--ignore-eos", "--temperature", "0", "--percentile-metrics", ",".join(LATENCIES),
           "--metric-percentiles", ",".join(map(str, PERCENTILES)), "--seed", str(args.seed), "--disable-tqdm",
           "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", f"{kv}.json",
           "--label", kv, "--metadata", f"kv={kv}", f"kv_tokens={args.kv_tokens}"]
    if args.dataset == "text":
        if dataset is None:
            raise ValueError("--dataset text needs the prompt file")
        cmd += ["--dataset-name", "sharegpt", "--dataset-path", str(dataset)]
    else:
        cmd += ["--dataset-name", "random", "--random-input-len", str(args.random_input_len), "--random-output-len",
                str(args.random_output_len), "--random-range-ratio", str(args.random_range_ratio)]
    return cmd + list(args.bench_arg)


def client_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def run_bench_process(cmd: list[str], env: dict, log_stem: Path, timeout: float) -> int | None:
    """`vllm bench serve` in a process group of its own, its output in log_stem.{out,err}: its exit status (None:
    stopped after timeout seconds)."""
    proc = sc.spawn(cmd, env, log_stem)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        sc.kill_group(proc, grace_s=5.0)


# ---- vllm bench serve's JSON ------------------------------------------------------------------------------------

def latency(doc: dict, metric: str, p: int) -> float | None:
    """A latency percentile (ms) of a `vllm bench serve` result: p<P>_<metric>_ms, the 50th also as median_."""
    value = doc.get(f"p{p}_{metric}_ms")
    if value is None and p == 50:
        value = doc.get(f"median_{metric}_ms")
    return value


def bench_row(kv: str, doc: dict) -> dict:
    """The soak row of one `vllm bench serve --save-result` JSON (its keys as vLLM 0.33 writes them)."""
    requests, completed = doc.get("num_prompts"), doc.get("completed")
    failed = doc.get("failed")
    if failed is None and requests is not None and completed is not None:
        failed = requests - completed
    row = dict(kv=kv, requests=requests, failed=failed, preemptions=None,
               ttft_p99_ms=latency(doc, "ttft", 99), tpot_p50_ms=latency(doc, "tpot", 50),
               output_tok_s=doc.get("output_throughput"), completed=completed)
    for metric in LATENCIES:
        for p in PERCENTILES:
            row[f"{metric}_p{p}_ms"] = latency(doc, metric, p)
    row.update(duration_s=doc.get("duration"), request_throughput=doc.get("request_throughput"),
               total_input_tokens=doc.get("total_input_tokens"), total_output_tokens=doc.get("total_output_tokens"),
               max_concurrency=doc.get("max_concurrency"), peak_concurrent_requests=doc.get("max_concurrent_requests"))
    return row


def compact_bench(doc: dict) -> dict:
    """The result as `vllm bench serve` saves it without --save-detailed (the per-request lists left out), with the
    count of failed requests' errors and the first few distinct ones."""
    errors = [e for e in doc.get("errors") or [] if e]
    out = {k: v for k, v in doc.items() if k not in PER_REQUEST}
    out["error_count"] = len(errors)
    out["distinct_errors"] = list(dict.fromkeys(e[:500] for e in errors))[:5]
    return out


# ---- sampling during the load -----------------------------------------------------------------------------------

def nvidia_smi_memory_mib() -> float | None:
    """The first GPU's used memory (MiB) as nvidia-smi reports it (no CUDA context); None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return float(out.splitlines()[0].strip())
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


class Sampler(threading.Thread):
    """GPU memory and the server's /metrics gauges every `interval` seconds until stop()."""

    def __init__(self, base_url: str, interval: float, gpu_memory: Callable[[], float | None] | None = None):
        super().__init__(daemon=True)
        self.base_url, self.interval = base_url, interval
        self.gpu_memory = gpu_memory or nvidia_smi_memory_mib
        self.samples: list[dict] = []
        self._stop_event = threading.Event()
        self._t0 = time.monotonic()

    def sample(self) -> dict:
        s = dict(t=round(time.monotonic() - self._t0, 2), gpu_mib=self.gpu_memory())
        status, text = sc.http_get(f"{self.base_url}/metrics", timeout=5.0)
        if status == 200:
            s.update(kv_usage=sc.kv_cache_usage(text),
                     running=sum(sc.metric_values(text, "vllm:num_requests_running")),
                     waiting=sum(sc.metric_values(text, "vllm:num_requests_waiting")),
                     preemptions=sc.counter(text, "vllm:num_preemptions_total"))
        return s

    def run(self) -> None:
        while True:
            self.samples.append(self.sample())
            if self._stop_event.wait(self.interval):
                break

    def stop(self) -> list[dict]:
        self._stop_event.set()
        self.join(timeout=60)
        return self.samples


def memory_summary(samples: list[dict], warmup_fraction: float, tolerance_mib: float) -> dict:
    """GPU memory over a run's samples: at the start, the largest, at the end; after the warm-up (the first
    warmup_fraction of the time from the first sample with requests running, else from the first sample, to the
    last) its growth over its first sample; flat when that is <= tolerance_mib (None: not sampled). And the largest
    KV-cache usage and requests running / waiting seen."""
    mem = [(s["t"], s["gpu_mib"]) for s in samples if s.get("gpu_mib") is not None]
    out: dict = dict(samples=len(samples), memory_samples=len(mem), flat=None)
    for key in ("kv_usage", "running", "waiting"):
        seen = [s[key] for s in samples if s.get(key) is not None]
        out[f"max_{key}"] = max(seen) if seen else None
    if not mem:
        return out
    busy = next((s["t"] for s in samples if (s.get("running") or 0) > 0), mem[0][0])
    cut = busy + warmup_fraction * (mem[-1][0] - busy)
    after = [m for t, m in mem if t >= cut]
    growth = max(after) - after[0]
    out.update(start_mib=mem[0][1], max_mib=max(m for _, m in mem), end_mib=mem[-1][1], after_warmup_mib=after[0],
               growth_after_warmup_mib=growth, flat=growth <= tolerance_mib)
    return out


def wait_idle(server, timeout_s: float = 60.0) -> tuple[float | None, float | None]:
    """(KV-cache usage last seen, seconds until it was 0 with nothing in flight, or None); one request after 15 s
    refreshes a stale gauge."""
    start, usage, probed = time.monotonic(), None, False
    while time.monotonic() - start < timeout_s:
        text = server.metrics()
        usage = sc.kv_cache_usage(text)
        if usage == 0 and sc.requests_in_flight(text) == 0:
            return usage, round(time.monotonic() - start, 1)
        if not probed and time.monotonic() - start > 15:
            sc.assert_still_serving(server)
            probed = True
        time.sleep(0.5)
    return usage, None


def served_kv_tokens(log_stem: Path) -> int | None:
    """The KV-cache tokens `vllm serve` logged ("GPU KV cache size: N tokens")."""
    for suffix in (".out", ".err"):
        path = Path(f"{log_stem}{suffix}")
        if path.exists():
            found = _KV_TOKENS_LOG.findall(path.read_text(errors="replace"))
            if found:
                return int(found[-1].replace(",", ""))
    return None


# ---- one KV cache -------------------------------------------------------------------------------------------------

def start_server(kv: str, args: argparse.Namespace, log_dir: Path):
    """The real server of a KV cache (serving_common.Server), started."""
    backend, preset, _ = KV[kv]
    return sc.Server(kv, args.model, backend, preset, log_dir, kv_serve_args(kv) + serve_extra(args)).start()


def soak_kv(kv: str, server, args: argparse.Namespace, dataset: Path | None, log_dir: Path,
            run_bench: Callable = run_bench_process) -> dict:
    """The load on a started server and what it left: the row (the bench's figures, preemptions, memory, checks;
    "bench_result": vllm bench serve's JSON, compacted). run_bench(cmd, env, log_stem, timeout) runs the benchmark
    command, giving its exit status."""
    bench_dir = log_dir / "bench"
    bench_dir.mkdir(parents=True, exist_ok=True)
    result_file = bench_dir / f"{kv}.json"
    result_file.unlink(missing_ok=True)
    before = server.metrics()
    fresh = None if args.no_greedy else sc.greedy_outputs(server, salt="fresh")
    cmd = bench_command(args, kv, server.base_url, server.model, dataset, bench_dir)
    sampler = Sampler(server.base_url, args.sample_interval)
    sampler.start()
    start = time.monotonic()
    try:
        status = run_bench(cmd, client_env(), log_dir / f"{kv}-bench", args.bench_timeout)
    finally:
        samples = sampler.stop()
    bench_s = round(time.monotonic() - start, 1)
    after = server.metrics()
    usage_after, idle_after_s = wait_idle(server)
    again = None if fresh is None else sc.greedy_outputs(server, salt="after")
    healthy = sc.http_get(f"{server.base_url}/health")[0] == 200
    doc = json.loads(result_file.read_text()) if result_file.exists() else None
    if doc is not None:
        row = bench_row(kv, doc)
        error = None if status == 0 else f"vllm bench serve exited with {status}"
    else:
        row = dict(kv=kv, requests=args.requests, failed=None, preemptions=None, ttft_p99_ms=None, tpot_p50_ms=None,
                   output_tok_s=None)
        why = "timed out" if status is None else f"exit status {status}"
        row_log = sc.log_tail(log_dir / f"{kv}-bench", 1500)
        error = f"vllm bench serve {why}, no result file: {row_log}"
    row["preemptions"] = (sc.counter(after, "vllm:num_preemptions_total")
                          - sc.counter(before, "vllm:num_preemptions_total"))
    row["aborted_requests"] = (sc.counter(after, "vllm:request_success_total", finished_reason="abort")
                               - sc.counter(before, "vllm:request_success_total", finished_reason="abort"))
    row["memory"] = memory_summary(samples, args.warmup_fraction, args.memory_tolerance_mib)
    greedy = None
    if fresh is not None:
        greedy = sc.prefix_agreement([o["token_ids"] for o in again], [o["token_ids"] for o in fresh])
        greedy = {k: greedy[k] for k in ("identical", "prompts", "mean_shared_prefix_fraction")}
    row.update(kv_tokens=args.kv_tokens, served_kv_tokens=served_kv_tokens(getattr(server, "log_stem", Path("-"))),
               concurrency=args.concurrency, dataset=args.dataset, bench_seconds=bench_s, bench_exit_status=status,
               greedy_after_soak=greedy, kv_usage_after=usage_after, idle_after_s=idle_after_s,
               healthy_after=healthy, startup_s=getattr(server, "startup_s", None), error=error,
               bench_command=shlex.join(cmd),
               serve_command=shlex.join(sc.serve_command(server.model, server.port, KV[kv][0],
                                                         kv_serve_args(kv) + serve_extra(args))))
    row["checks"] = dict(
        zero_failed=row["failed"] == 0 and row.get("completed") == row["requests"],
        preempted=row["preemptions"] > 0,
        memory_flat=row["memory"]["flat"],
        greedy_same_after=None if greedy is None else greedy["identical"] == greedy["prompts"],
        idle_after=idle_after_s is not None,
        healthy_after=healthy,
    )
    row["passed"] = error is None and all(v is not False for v in row["checks"].values())
    if doc is not None:
        row["bench_result"] = compact_bench(doc)
    return row


def failed_row(kv: str, args: argparse.Namespace, error: str) -> dict:
    return dict(kv=kv, requests=args.requests, failed=None, preemptions=None, ttft_p99_ms=None, tpot_p50_ms=None,
                output_tok_s=None, kv_tokens=args.kv_tokens, error=error[:3000], passed=False)


# ---- results -------------------------------------------------------------------------------------------------------

def markdown(rows: list[dict], meta: dict) -> str:
    cols = [("KV cache", lambda r: r["kv"]), ("requests", lambda r: str(r.get("requests") or "")),
            ("failed", lambda r: "" if r.get("failed") is None else str(r["failed"])),
            ("preemptions", lambda r: engine_rows.fmt(r.get("preemptions"), ".0f"))]
    for metric in ("ttft", "tpot", "itl"):
        for p in (50, 99):
            cols.append((f"{metric.upper()} p{p} ms",
                         lambda r, k=f"{metric}_p{p}_ms": engine_rows.fmt(r.get(k), ".1f")))
    cols += [("output tok/s", lambda r: engine_rows.fmt(r.get("output_tok_s"), ",.0f")),
             ("GPU MiB growth after warm-up", lambda r: engine_rows.fmt((r.get("memory") or {}).get(
                 "growth_after_warmup_mib"), ".0f")),
             ("greedy same after", lambda r: "" if not r.get("greedy_after_soak") else
              f"{r['greedy_after_soak']['identical']}/{r['greedy_after_soak']['prompts']}"),
             ("result", lambda r: "passed" if r.get("passed") else
              "**FAILED** " + ", ".join([k for k, v in (r.get("checks") or {}).items() if v is False]
                                        + ([str(r["error"])[:200].replace("|", "\\|").replace("\n", " ")]
                                           if r.get("error") else [])))]
    lines = ["# Soak: vllm bench serve against vllm serve, preemption on\n",
             "Latencies from `vllm bench serve` (TTFT: time to first token; TPOT: time per output token after the "
             "first; ITL: inter-token latency), preemptions from vllm:num_preemptions_total, GPU memory sampled with "
             "nvidia-smi.\n", engine_rows.markdown_table(rows, cols), "", f"![latency percentiles]({meta['png']})", "",
             "## Commands", ""]
    for r in rows:
        if r.get("serve_command"):
            lines += [f"- {r['kv']}: `{r['serve_command']}`", f"  then `{r['bench_command']}`"]
    lines += ["", f"Script: `{meta['command']}` (rows of earlier calls keep theirs: soak.json's rows[].command).", "",
              common.not_on_hopper_markdown()]
    return "\n".join(lines)


def plot(path: Path, rows: list[dict]) -> None:
    """p50 and p99 of TTFT, TPOT and ITL, one group of bars per KV cache; output tok/s beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kvs = [r["kv"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4.2))
    for ax, metric in zip(axes, ("ttft", "tpot", "itl")):
        for i, p in enumerate((50, 99)):
            ys = [r.get(f"{metric}_p{p}_ms") or 0.0 for r in rows]
            bars = ax.bar([j + 0.4 * i for j in range(len(rows))], ys, 0.4, label=f"p{p}")
            for bar, y in zip(bars, ys):
                ax.annotate(f"{y:.1f}", (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom", fontsize=7)
        ax.set_xticks([j + 0.2 for j in range(len(rows))], kvs)
        ax.set_title(f"{metric.upper()} ms (lower is better)")
        ax.legend(fontsize=8)
    ys = [r.get("output_tok_s") or 0.0 for r in rows]
    bars = axes[3].bar(range(len(rows)), ys, color=["tab:orange" if k != "bf16" else "tab:blue" for k in kvs])
    for bar, y in zip(bars, ys):
        axes[3].annotate(f"{y:,.0f}", (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom", fontsize=7)
    axes[3].set_xticks(range(len(rows)), kvs)
    axes[3].set_title("output tok/s (higher is better)")
    requests = sorted({r.get("requests") for r in rows} - {None})
    conc = sorted({r.get("concurrency") for r in rows} - {None})
    fig.suptitle(f"vllm bench serve soak: {'/'.join(map(str, requests))} requests a KV cache, concurrency "
                 f"{'/'.join(map(str, conc))}, preemption on", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(rows: list[dict], args: argparse.Namespace, command: str) -> dict:
    """Each row's vllm bench serve JSON into the folder <--out>/, the rows merged into soak.json; the Markdown and PNG
    of every row it then holds."""
    meta = common.provenance(command)
    stem = common.stem_of(args.out)
    for row in rows:
        bench = row.pop("bench_result", None)
        if bench is not None:
            path = stem / f"{row['kv']}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(bench, indent=1) + "\n")
            row["bench_json"] = str(path.relative_to(common.ROOT) if path.is_relative_to(common.ROOT) else path)
    doc = sc.write_summary(args.summary, "rows", rows, meta)
    png = common.with_ext(stem, ".png")
    plot(png, doc["rows"])
    common.write_markdown(common.with_ext(stem, ".md"), markdown(doc["rows"], dict(meta, png=png.name)), meta)
    return doc


def run(args: argparse.Namespace, command: str, server_for: Callable | None = None,
        run_bench: Callable = run_bench_process, write: bool = True) -> list[dict]:
    """Each KV cache's server, load and row, the results written after each when `write` (a cut-off run keeps its
    rows). server_for(kv): a started server (default: the real one); run_bench: as soak_kv's."""
    log_dir = args.logs or Path(tempfile.mkdtemp(prefix="tq-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    dataset = None
    if args.dataset == "text":
        rows = sc.soak_prompt_set(
            sc.read_sources(args.data), args.requests, seed=args.seed, prompt_words=args.prompt_words,
            answer_words=args.answer_words, median_prompt_words=args.median_prompt_words,
            median_answer_words=args.median_answer_words)
        dataset = sc.write_sharegpt(log_dir / "prompts.json", rows)
    server_for = server_for or (lambda kv: start_server(kv, args, log_dir))
    done = []
    for kv in args.kv_list:
        try:
            server = server_for(kv)
        except Exception as exc:  # noqa: BLE001 - a row that says why
            row = failed_row(kv, args, f"server did not start: {exc}")
        else:
            try:
                row = soak_kv(kv, server, args, dataset, log_dir, run_bench)
            except Exception as exc:  # noqa: BLE001
                row = failed_row(kv, args, f"{type(exc).__name__}: {exc}\n{sc.log_tail(server.log_stem)}")
            finally:
                server.stop()
        row.update(command=command, gpu=common.gpu_info()["name"], commit=common.git_commit())
        done.append(row)
        print(json.dumps({k: row.get(k) for k in ("kv", "requests", "failed", "preemptions", "ttft_p99_ms",
                                                  "tpot_p50_ms", "output_tok_s", "passed", "error")}), flush=True)
        if write:
            write_results([row], args, command)
    return done


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = sc.missing_model(args.model)
    if why is None and args.dataset == "text" and args.data is None:
        why = sc.missing_text_data()
    if why:
        sys.exit(f"{NAME}: {why}")
    rows = run(args, common.command_line(NAME, argv))
    return 0 if rows and all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
