"""Speculative decoding on the TurboQuant backend (--attention-backend CUSTOM) with CUDA graphs against non-speculative
greedy decoding on the same backend: identical outputs against a rounding control, acceptance rate and speed-up (GPU;
the converted SmolLM2-135M-Instruct).

For each KV cache (--kv, default tq4,tq3; bf16 and fp8 = FLASH_ATTN, added as controls unless --no-control) one
engine per process (LLM.generate, greedy, ignore_eos, no prefix caching, CUDA graphs: vLLM's default compilation, or
with --quick decode graphs only, {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}):
  - the reference, no speculation: the prompt groups timed, then again with logprobs=2 (each position's runner-up
    and its margin to the greedy token), then once more rebatched (each group in reverse order, in two halves);
  - per method (--methods, default ngram, or ngram_gpu where numba is missing): the same with --speculative-config,
    e.g. {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    (draft_model: the model drafts for itself; ngram_gpu: vLLM's GPU n-gram proposer).
Prompts (serving_common.spec_prompt_set, from --data's real text): a "repetitive" group (a passage repeated, then
restarted: drafts accept, and whole batches verify K + 1 tokens a request, which vLLM replays in FULL CUDA graphs), a
"plain" group (passages continued as they are), each run as one batch; then the first --single repetitive prompts one
at a time.

Per method: identical outputs (prompt by prompt, whole token sequences) against the reference, and the rounding
control: the reference against its rebatched run, plain greedy decoding both, where only the batch arithmetic differs
(split counts, GEMM shapes; the single runs' control: the same prompts in the batch run). A quantized cache turns a
1-ulp difference into a different code for the next token's key and the greedy text parts from there
(quality_diagnosis/cpu-smollm2-135m-rounding-sensitivity.md), so speculation, which changes the batch arithmetic,
passes when its outputs diverge no more often than the control's, within three standard deviations of two Poisson
counts (within_rounding). With --batch-invariant (VLLM_BATCH_INVARIANT=1: GEMMs without split-k, and our backend
running every row through one kernel at one split) nothing is left to differ: every output must equal greedy's.
The judge, a third engine (the reference's configuration), takes greedy's and each method's outputs after their
prompts, teacher-forced: a continuation token it ranks more than --judge-margin nats below its own top token, given
the very same prefix, is one the model would not have chosen; greedy's count is the judge's own noise (prefill
arithmetic against decode's), the method's the evidence of a wrong verification, free of the divergences' chaos.
A divergence is "explained" when the speculative run took the reference's runner-up within --near-tie nats
(informational); the acceptance rate
(vllm:spec_decode_num_accepted_tokens_total / vllm:spec_decode_num_draft_tokens_total over the timed batches, from
the engine's Prometheus registry, the text /metrics serves); speed-up = the reference's seconds / the speculative
run's (batches; one at a time); the CUDA-graph steps vLLM logged (cudagraph_metrics): FULL-graph steps and those of
>= DENSE_PREFILL_MIN_TOKENS tokens (our builder sends such verification batches to its dense-prefill path). An
engine that does not start is recorded with its error (refused_at_startup), never skipped silently.

On the GPU machine (the model converted first: turboquant-vllm model smollm2 --out DIR):
    python -m benchmarks serving_spec_decode --model DIR [--data DIR] [--quick] [--kv tq4,tq3] [--batch-invariant]
Writes benchmarks/results/serving/<gpu>-spec-decode.{json,md} (--out; every comparison in full; entries of other KV
caches and methods kept) and merges the summary into benchmarks/results/serving/soak.json's "spec_decode".
The quick comparison on tq4 is a test: TURBOQUANT_SMOLLM2_DIR=DIR python -m pytest -m gpu
tests/serving/test_gpu_spec_decode.py
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path

from turboquant_vllm.core.presets import PRESETS

from . import common, engine_rows
from . import serving_common as sc

NAME = "serving_spec_decode"
TAG = "SPEC_ROW"

READY = "SPEC_ENGINE_READY"

# kv -> (attention backend, None: vLLM's pick; our preset); vLLM's compressed caches that run on Hopper are named by
# their kv_cache_dtype (common.VLLM_KV), the others a line of the report
KV = {**{p: ("CUSTOM", p) for p in PRESETS}, "bf16": ("FLASH_ATTN", None), "fp8": ("FLASH_ATTN", None),
      **{dtype: (backend, None) for dtype, backend in common.VLLM_KV.items()}}

# vLLM's fp8 e4m3 cache on FLASH_ATTN: its own quantized cache, a second control
KV_CACHE_DTYPE = {"fp8": "fp8", **{dtype: dtype for dtype in common.VLLM_KV}}

CONTROLS = ("bf16", "fp8")

METHODS = ("ngram", "ngram_gpu", "draft_model")

DENSE_PREFILL_MIN_TOKENS = 256  # turboquant_vllm.vllm.metadata's (a CPU test keeps the two equal)

FAST_GRAPHS = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}

BATCH_INVARIANT_LABEL = "batch-invariant"

WARMUP_PROMPTS = 16

DIVERGENCES_KEPT = 20

FULL = dict(repetitive=128, plain=128, max_tokens=128, single=8)

QUICK = dict(repetitive=100, plain=100, max_tokens=64, single=4)



# ---- arguments ---------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = common.parser(NAME, __doc__)
    sc.add_model_and_data(ap, f"the text folder (wikitext2-test.txt, paul_graham_essays/, books/); default: "
                                 f"${sc.TEXT_DATA_ENV}, .gpukit/w2/data or ../shared/data")
    ap.add_argument("--kv", default="tq4,tq3", help=f"KV caches, comma-separated, of {sorted(KV)}")
    ap.add_argument("--methods", default="auto",
                    help=f"speculative methods, comma-separated, of {list(METHODS)}; auto: ngram where numba (its "
                         f"proposer's compiler) imports, else ngram_gpu")
    ap.add_argument("--no-control", action="store_true", help=f"leave out the {', '.join(CONTROLS)} (FLASH_ATTN) "
                                                                 f"controls")
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK['repetitive']} + {QUICK['plain']} prompts, {QUICK['max_tokens']} tokens, decode "
                         f"CUDA graphs only (no torch.compile): ~6 minutes on an H100 for two presets and the control")
    ap.add_argument("--repetitive", type=int, help=f"repetitive prompts (default {FULL['repetitive']})")
    ap.add_argument("--plain", type=int, help=f"plain prompts (default {FULL['plain']})")
    ap.add_argument("--max-tokens", type=int, help=f"tokens generated a prompt (default {FULL['max_tokens']})")
    ap.add_argument("--single", type=int, help=f"repetitive prompts also run one at a time (default {FULL['single']})")
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=5)
    ap.add_argument("--fast-graphs", action="store_true", help=f"compilation_config {FAST_GRAPHS} (--quick's)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="every engine under VLLM_BATCH_INVARIANT=1: speculation must then give greedy decoding's "
                         f"tokens exactly (methods labelled '{BATCH_INVARIANT_LABEL}')")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--near-tie", type=float, default=0.3,
                    help="nats: a divergence at the reference's runner-up within this margin is explained")
    ap.add_argument("--judge-margin", type=float, default=0.5,
                    help="nats: the judge counts a continuation token the non-speculative engine, teacher-forced on "
                         "the same prefix, ranks below its own top token by more than this")
    ap.add_argument("--no-judge", action="store_true", help="skip the judge's engine")
    ap.add_argument("--seed", type=int, default=0, help="of the prompt set")
    ap.add_argument("--timeout", type=float, default=600, help="seconds an engine's process may take")
    ap.add_argument("--out", type=Path, default=common.with_ext(common.result_stem("serving", "spec-decode"), ".json"),
                    help="the detailed results, .md beside it (default: benchmarks/results/serving/"
                         "<gpu>-spec-decode.json)")
    ap.add_argument("--summary", type=Path, default=sc.summary_path(),
                    help="the summary to merge into (default: benchmarks/results/serving/soak.json)")
    ap.add_argument("--logs", type=Path, help="the engines' logs and prompt files (default: a temporary folder)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return args
    sc.apply_scale(args, QUICK, FULL)
    args.fast_graphs = args.fast_graphs or args.quick
    args.kv_list = [k.strip() for k in args.kv.split(",") if k.strip()]
    args.method_list = [auto_method() if m.strip() == "auto" else m.strip() for m in args.methods.split(",")
                        if m.strip()]
    bad = [k for k in args.kv_list if k not in KV] + [m for m in args.method_list if m not in METHODS]
    if bad or not args.kv_list or not args.method_list:
        ap.error(f"unknown or no --kv / --methods: {bad}; KV caches {sorted(KV)}, methods {list(METHODS)}")
    if not args.no_control:
        args.kv_list += [c for c in CONTROLS if c not in args.kv_list]
    if args.repetitive < 1 or args.plain < 0 or args.max_tokens < 2 or args.single < 0:
        ap.error("--repetitive >= 1, --plain >= 0, --max-tokens >= 2, --single >= 0")
    if args.single > args.repetitive:
        ap.error("--single must not exceed --repetitive (the single runs take the first repetitive prompts)")
    if not 1 <= args.prompt_lookup_min <= args.prompt_lookup_max or args.num_speculative_tokens < 1:
        ap.error("need 1 <= --prompt-lookup-min <= --prompt-lookup-max and --num-speculative-tokens >= 1")
    return args


def auto_method() -> str:
    """vLLM's CPU n-gram proposer needs numba (a vLLM requirement the device kit may lack); its GPU one does not."""
    import importlib.util

    return "ngram" if importlib.util.find_spec("numba") is not None else "ngram_gpu"


def speculative_config(method: str, args: argparse.Namespace) -> dict:
    """--speculative-config of a method (vLLM 0.33's SpeculativeConfig fields)."""
    if method in ("ngram", "ngram_gpu"):
        return {"method": method, "num_speculative_tokens": args.num_speculative_tokens,
                "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    if method == "draft_model":
        return {"method": "draft_model", "model": args.model, "num_speculative_tokens": args.num_speculative_tokens}
    raise ValueError(f"unknown method {method!r}")


def case_spec(kv: str, method: str | None, args: argparse.Namespace, prompts_file: Path) -> dict:
    """What one engine's process runs (its --child file)."""
    backend, preset = KV[kv]
    return dict(kv=kv, method=method, backend=backend, preset=preset, kv_cache_dtype=KV_CACHE_DTYPE.get(kv, "auto"),
                model=args.model,
                spec=speculative_config(method, args) if method else None, prompts_file=str(prompts_file),
                max_tokens=args.max_tokens, single=args.single, logprobs=method is None,
                fast_graphs=args.fast_graphs, batch_invariant=args.batch_invariant, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs,
                gpu_memory_utilization=args.gpu_memory_utilization)


def engine_kwargs(case: dict) -> dict:
    """LLM(...) of a case: greedy-comparable (seeded, no prefix caching), stats on (the Prometheus registry fills),
    CUDA-graph steps logged, the case's attention backend and speculative config."""
    kw = dict(model=case["model"], seed=0, max_model_len=case["max_model_len"], max_num_seqs=case["max_num_seqs"],
              gpu_memory_utilization=case["gpu_memory_utilization"], enable_prefix_caching=False,
              disable_log_stats=False, cudagraph_metrics=True, attention_config={"backend": case["backend"]},
              kv_cache_dtype=case.get("kv_cache_dtype", "auto"))
    if case["spec"]:
        kw["speculative_config"] = dict(case["spec"])
    if case["fast_graphs"]:
        kw["compilation_config"] = dict(FAST_GRAPHS)
    return kw


# ---- the engine's process ---------------------------------------------------------------------------------------

def spec_counts(text: str) -> dict:
    """vLLM's speculative-decoding counters in a /metrics text (summed over engines): drafts, draft tokens, accepted
    tokens, accepted tokens by draft position."""
    per_pos: dict[int, float] = {}
    for name, labels, value in sc.parse_metrics(text):
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total" and "position" in labels:
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + value
    return dict(drafts=sc.counter(text, "vllm:spec_decode_num_drafts_total"),
                draft_tokens=sc.counter(text, "vllm:spec_decode_num_draft_tokens_total"),
                accepted_tokens=sc.counter(text, "vllm:spec_decode_num_accepted_tokens_total"),
                accepted_per_pos=per_pos)


def acceptance(before: dict, after: dict) -> dict:
    """The counters' change between two spec_counts, and the rates: accepted / drafted tokens, the mean acceptance
    length (1 + accepted / drafts: the bonus token counted), each position's accepted / drafts."""
    d = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted_tokens")}
    pos = {p: after["accepted_per_pos"].get(p, 0.0) - before["accepted_per_pos"].get(p, 0.0)
           for p in sorted(after["accepted_per_pos"])}
    d["acceptance_rate"] = d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else None
    d["mean_acceptance_length"] = 1 + d["accepted_tokens"] / d["drafts"] if d["drafts"] else None
    d["per_position_rate"] = [v / d["drafts"] for v in pos.values()] if d["drafts"] else []
    return d


def sum_acceptance(parts: list[dict]) -> dict:
    """Acceptance over several timed runs (their counter changes added)."""
    zero = dict(drafts=0.0, draft_tokens=0.0, accepted_tokens=0.0, accepted_per_pos={})
    total = dict(zero)
    for p in parts:
        for k in ("drafts", "draft_tokens", "accepted_tokens"):
            total[k] += p[k]
    return acceptance(zero, total)


def top_two(position: dict | None) -> tuple[int | None, float | None]:
    """(the runner-up token, the greedy token's logprob margin over it) of one position's logprobs dict."""
    if not position or len(position) < 2:
        return None, None
    (_, first), (second, runner) = sorted(position.items(), key=lambda kv: -kv[1].logprob)[:2]
    return second, round(first.logprob - runner.logprob, 5)


def prometheus_text() -> str:
    """This process's Prometheus registry as /metrics would serve it (the engine front end's stat loggers)."""
    import prometheus_client

    return prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()


def run_engine(llm, case: dict, metrics_text=prometheus_text) -> dict:
    """The case's runs on a built engine: warm-up, each prompt group timed as one batch (token ids and acceptance),
    the single runs, and for the reference the logprobs pass (runner-ups and margins; whether its tokens repeat the
    timed pass's) and the rebatched pass (the rounding control: each batch group in reverse order, in two halves)."""
    from vllm import SamplingParams

    groups = json.loads(Path(case["prompts_file"]).read_text())

    def params(max_tokens: int, logprobs: int | None = None):
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs,
                              detokenize=False)

    def generate(prompts: list[str], max_tokens: int, logprobs: int | None = None):
        return llm.generate(prompts, params(max_tokens, logprobs), use_tqdm=False)

    texts = {name: [p["prompt"] for p in items] for name, items in groups.items()}
    texts["single"] = texts["repetitive"][: case["single"]]
    for name in ("repetitive", "plain"):  # first uses (kernel compiles, verification shapes) outside timed runs
        if texts[name]:
            generate(texts[name][:WARMUP_PROMPTS], min(16, case["max_tokens"]))

    def run_group(name: str, logprobs: int | None = None):
        if name == "single":  # one request at a time
            return [generate([p], case["max_tokens"], logprobs)[0] for p in texts[name]]
        return generate(texts[name], case["max_tokens"], logprobs)

    out: dict = {"groups": {}}
    for name, prompts in texts.items():
        if not prompts:
            continue
        before = spec_counts(metrics_text())
        start = time.perf_counter()
        outs = run_group(name)
        seconds = time.perf_counter() - start
        out["groups"][name] = dict(seconds=seconds, tokens=[list(o.outputs[0].token_ids) for o in outs],
                                   prompt_ids=[list(o.prompt_token_ids) for o in outs],
                                   spec=acceptance(before, spec_counts(metrics_text())))
    if case["logprobs"]:
        for name, group in out["groups"].items():
            outs = run_group(name, logprobs=2)
            pairs = [[top_two(pos) for pos in (o.outputs[0].logprobs or [])] for o in outs]
            group["runner_up"] = [[r for r, _ in p] for p in pairs]
            group["margin"] = [[m for _, m in p] for p in pairs]
            group["logprobs_pass_same_tokens"] = [list(o.outputs[0].token_ids) for o in outs] == group["tokens"]
        for name in ("repetitive", "plain"):
            if name in out["groups"]:
                out["groups"][name]["rebatched_tokens"] = rebatched(texts[name], case["max_tokens"], generate)
    return out


def judge_engine(llm, case: dict) -> dict:
    """The judge: each sequence (prompt ids + a continuation) teacher-forced through the non-speculative engine, and
    per continuation token the margin (nats) by which the engine preferred its own top token given the same prefix
    (0 where the token is its top). Per label: positions judged, those over the case's judge_margin, the largest."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=1, detokenize=False)
    found = {}
    for label, pairs in json.loads(Path(case["judge_file"]).read_text()).items():
        outs = llm.generate([{"prompt_token_ids": p + c} for p, c in pairs], params, use_tqdm=False)
        margins = []
        for (p, c), o in zip(pairs, outs):
            for j, token in enumerate(c):
                position = o.prompt_logprobs[len(p) + j]
                top = max(lp.logprob for lp in position.values())
                margins.append(top - position[token].logprob)
        found[label] = dict(positions=len(margins), over=sum(m > case["judge_margin"] for m in margins),
                            largest=round(max(margins, default=0.0), 4))
    return found


def rebatched(prompts: list[str], max_tokens: int, generate) -> list[list[int]]:
    """Greedy tokens of prompts run in reverse order in two halves (other batch sizes, other split counts and GEMM
    shapes than one batch in order), listed in the prompts' order."""
    order = list(reversed(range(len(prompts))))
    half = (len(order) + 1) // 2
    tokens: dict[int, list[int]] = {}
    for part in (order[:half], order[half:]):
        if part:
            outs = generate([prompts[i] for i in part], max_tokens)
            tokens.update({i: list(o.outputs[0].token_ids) for i, o in zip(part, outs)})
    return [tokens[i] for i in range(len(prompts))]


def child_main(path: str) -> int:
    """One engine's process: build it (READY marks a start), run the case, write its row beside the case file and
    print where (TAG; the row's token lists would bury the log)."""
    case = json.loads(Path(path).read_text())
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(**engine_kwargs(case))
    startup_s = time.perf_counter() - start
    print(READY, flush=True)
    ran = {"judge": judge_engine(llm, case)} if case.get("judge_file") else run_engine(llm, case)
    row = dict(ran, startup_s=startup_s, engine=engine_rows.engine_facts(llm))
    config = llm.llm_engine.vllm_config
    row["engine"]["speculative_config"] = str(config.speculative_config) if config.speculative_config else None
    llm.llm_engine.do_log_stats()  # flush the last interval's CUDA-graph table into the log
    engine_rows.emit_row(TAG, save_row(path, row))
    return 0


def save_row(case_path: str, row: dict) -> dict:
    """The row written beside its case file; what the child prints instead of it."""
    row_file = Path(f"{case_path}.row.json")
    row_file.write_text(json.dumps(row))
    return {"row_file": str(row_file)}


# ---- the parent: engines, comparisons, results -------------------------------------------------------------------

_CG_ROW = re.compile(r"\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(FULL|PIECEWISE|NONE)\s*\|\s*(\d+)\s*\|")


def cudagraph_steps(log: str) -> dict:
    """The steps vLLM's cudagraph_metrics tables (CUDAGraphLogging) logged, by runtime mode, and the FULL-graph steps
    of >= DENSE_PREFILL_MIN_TOKENS (padded) tokens."""
    by_mode: dict[str, int] = {}
    dense_full = 0
    for m in _CG_ROW.finditer(log):
        padded, mode, count = int(m.group(2)), m.group(4), int(m.group(5))
        by_mode[mode] = by_mode.get(mode, 0) + count
        if mode == "FULL" and padded >= DENSE_PREFILL_MIN_TOKENS:
            dense_full += count
    return dict(by_mode=by_mode, full_steps_dense_size=dense_full)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where a and b differ (the shorter one's end when one is the other's prefix); None when
    they are identical."""
    if a == b:
        return None
    return sc.shared_prefix(a, b)


def compare_outputs(reference: dict, speculative: dict, near_tie: float) -> dict:
    """A speculative group's token ids against the reference's, prompt by prompt: identical, explained divergences
    (the speculative token is the reference's runner-up, its margin <= near_tie), unexplained ones, the first
    DIVERGENCES_KEPT divergences, and the shared-prefix agreement."""
    ref, spec = reference["tokens"], speculative["tokens"]
    if len(ref) != len(spec):
        raise ValueError(f"{len(spec)} speculative outputs, {len(ref)} references")
    runner, margin = reference.get("runner_up"), reference.get("margin")
    divergences = []
    for i, (a, b) in enumerate(zip(ref, spec)):
        pos = first_divergence(a, b)
        if pos is None:
            continue
        d = dict(prompt=i, position=pos, reference=a[pos] if pos < len(a) else None,
                 speculative=b[pos] if pos < len(b) else None, runner_up=None, margin=None)
        if runner is not None and pos < len(runner[i]):
            d["runner_up"], d["margin"] = runner[i][pos], margin[i][pos]
        d["explained"] = bool(d["speculative"] is not None and d["speculative"] == d["runner_up"]
                              and d["margin"] is not None and d["margin"] <= near_tie)
        divergences.append(d)
    agree = sc.prefix_agreement(spec, ref)
    explained = sum(d["explained"] for d in divergences)
    return dict(prompts=len(ref), identical=len(ref) - len(divergences), explained=explained,
                unexplained=len(divergences) - explained,
                mean_shared_prefix_fraction=agree["mean_shared_prefix_fraction"],
                divergences=divergences[:DIVERGENCES_KEPT])


def divergent(a: list[list[int]], b: list[list[int]]) -> int:
    """Prompts whose token sequences differ."""
    return sum(x != y for x, y in zip(a, b, strict=True))


def within_rounding(divergences: int, control: int) -> bool:
    """Speculation diverges from greedy decoding no more often than rebatching greedy decoding does: at most three
    standard deviations of the difference of two Poisson counts above the control."""
    return divergences <= control + 3 * math.sqrt(divergences + control)


def error_lines(log: str, first: int = 3) -> list[str]:
    """The distinct error lines of a log (engine_rows.LOG_ERROR's): the first few (a root cause, e.g. vLLM's
    refusal) and the last (what ended the process, e.g. "Engine core initialization failed")."""
    found = list(dict.fromkeys(m.group(0).strip()[:500] for m in map(engine_rows.LOG_ERROR.search, log.splitlines())
                               if m))
    return found[:first] + ([found[-1]] if len(found) > first else [])


def child_command(case_file: Path) -> list[str]:
    return common.module_command(NAME, "--child", str(case_file))


def run_case(case: dict, log_dir: Path, timeout: float) -> dict:
    """One engine's process: its row, or what stopped it (refused at startup or failed later) with the log's error."""
    name = f"{case['kv']}-{case['method'] or 'reference'}" + ("-bi" if case.get("batch_invariant") else "")
    case_file = log_dir / f"{name}.case.json"
    case_file.write_text(json.dumps(case, indent=1))
    env = common.child_env(sc.server_env(sc.plugin_site(log_dir), case["preset"]))
    env.pop("VLLM_BATCH_INVARIANT", None)
    if case.get("batch_invariant"):
        env["VLLM_BATCH_INVARIANT"] = "1"
    start = time.perf_counter()
    row, text, why = engine_rows.run_child(child_command(case_file), env, log_dir / f"{name}.log", timeout, TAG)
    result = dict(kv=case["kv"], method=case["method"], seconds=round(time.perf_counter() - start, 1),
                  log=str(log_dir / f"{name}.log"), cudagraph_steps=cudagraph_steps(text))
    if row is None:
        errors = error_lines(text)
        return dict(result, error=f"{why}: {' | '.join(errors)}"[:2000] if errors else why,
                    refused_at_startup=READY not in text)
    if "row_file" in row:
        row = json.loads(Path(row["row_file"]).read_text())
    return dict(result, **row, error=None, refused_at_startup=False)


BATCH_GROUPS = ("repetitive", "plain")


def judge(kv: str, reference: dict, ran: dict, args: argparse.Namespace, log_dir: Path) -> dict:
    """The judge's engine (the reference's configuration, no speculation) on greedy's and each method's batch-group
    outputs after their prompts: {label: judge_engine's figures} ("greedy" and the methods), {} if anything failed."""
    if reference.get("error") or any(r.get("error") for r in ran.values()):
        return {}
    groups = [n for n in BATCH_GROUPS if n in reference["groups"]]
    prompt_ids = [p for n in groups for p in reference["groups"][n]["prompt_ids"]]
    outputs = {"greedy": reference, **ran}
    sequences = {label: [[p, c] for p, c in zip(prompt_ids, (t for n in groups for t in row["groups"][n]["tokens"]))]
                 for label, row in outputs.items()}
    judge_file = log_dir / f"{kv}-judge.sequences.json"
    judge_file.write_text(json.dumps(sequences))
    case = dict(case_spec(kv, None, args, log_dir / "prompts.json"), method="judge",
                judge_file=str(judge_file), judge_margin=args.judge_margin)
    row = run_case(case, log_dir, args.timeout)
    return row.get("judge") or {}


def judge_entry(judged: dict, method: str, margin: float) -> dict:
    """An entry's judge figures: teacher-forced continuation tokens of greedy decoding and of the method that the
    non-speculative engine ranks more than `margin` nats below its top token (greedy's: the judge's own noise)."""
    if "greedy" not in judged or method not in judged:
        return dict(judge_positions=None, judge_over_greedy=None, judge_over_speculative=None)
    g, m = judged["greedy"], judged[method]
    return dict(judge_positions=m["positions"], judge_over_greedy=g["over"], judge_over_speculative=m["over"],
                judge_largest_speculative=m["largest"], judge_margin=margin)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def evaluate(kv: str, method: str, reference: dict, speculative: dict, args: argparse.Namespace) -> dict:
    """The comparison entry of a (KV cache, method): the summary keys first (soak.json's spec_decode), then detail."""
    if args.batch_invariant:
        method = f"{method}, {BATCH_INVARIANT_LABEL}"
    entry = dict(kv=kv, method=method, prompts=args.repetitive + args.plain, identical=None, control_identical=None,
                 acceptance_rate=None, explained_near_ties=None, unexplained=None, speedup_batch=None,
                 speedup_single=None,
                 num_speculative_tokens=args.num_speculative_tokens, full_graph_steps=None,
                 full_graph_steps_dense_size=None, refused_at_startup=speculative.get("refused_at_startup", False),
                 error=speculative.get("error") or (f"reference: {reference['error']}" if reference.get("error")
                                                    else None))
    if entry["error"]:
        entry["passed"] = False
        return entry
    groups = {}
    for name, ref in reference["groups"].items():
        spec = speculative["groups"][name]
        if name == "single":  # the same prompts decoded in the repetitive batch
            control = reference["groups"]["repetitive"]["tokens"][: len(ref["tokens"])]
        else:
            control = ref["rebatched_tokens"]
        groups[name] = dict(compare_outputs(ref, spec, args.near_tie),
                            control_identical=len(ref["tokens"]) - divergent(ref["tokens"], control),
                            reference_s=round(ref["seconds"], 3),
                            speculative_s=round(spec["seconds"], 3), speedup=ratio(ref["seconds"], spec["seconds"]),
                            acceptance=spec["spec"],
                            reference_deterministic=ref.get("logprobs_pass_same_tokens"))
    batch = [n for n in ("repetitive", "plain") if n in groups]
    entry.update(
        prompts=sum(groups[n]["prompts"] for n in batch),
        identical=sum(groups[n]["identical"] for n in batch),
        control_identical=sum(groups[n]["control_identical"] for n in batch),
        explained_near_ties=sum(groups[n]["explained"] for n in batch),
        unexplained=sum(groups[n]["unexplained"] for n in batch),
        acceptance_rate=sum_acceptance([speculative["groups"][n]["spec"] for n in batch])["acceptance_rate"],
        speedup_batch=ratio(sum(reference["groups"][n]["seconds"] for n in batch),
                            sum(speculative["groups"][n]["seconds"] for n in batch)),
        speedup_single=groups["single"]["speedup"] if "single" in groups else None,
        full_graph_steps=speculative["cudagraph_steps"]["by_mode"].get("FULL", 0),
        full_graph_steps_dense_size=speculative["cudagraph_steps"]["full_steps_dense_size"],
    )
    if entry["acceptance_rate"] is not None:
        entry["acceptance_rate"] = round(entry["acceptance_rate"], 4)
    judged = [entry] + ([groups["single"]] if "single" in groups else [])
    if args.batch_invariant:  # a row's arithmetic no longer depends on its batch: nothing may differ
        entry["passed"] = all(g["identical"] == g["prompts"] for g in judged)
    else:
        entry["passed"] = all(within_rounding(g["prompts"] - g["identical"], g["prompts"] - g["control_identical"])
                              for g in judged)
    entry["groups"] = groups
    entry["engines"] = {"reference": reference.get("engine"), "speculative": speculative.get("engine")}
    entry["startup_s"] = {"reference": reference.get("startup_s"), "speculative": speculative.get("startup_s")}
    entry["speculative_config"] = speculative.get("engine", {}).get("speculative_config")
    return entry


SUMMARY_KEYS = ("kv", "method", "prompts", "identical", "control_identical", "judge_positions", "judge_over_greedy",
                "judge_over_speculative", "acceptance_rate", "explained_near_ties", "unexplained", "speedup_batch",
                "speedup_single", "num_speculative_tokens", "full_graph_steps", "full_graph_steps_dense_size",
                "refused_at_startup", "error", "passed")


def summary_entry(entry: dict, command: str) -> dict:
    return dict({k: entry.get(k) for k in SUMMARY_KEYS}, command=command, gpu=entry.get("gpu"),
                commit=entry.get("commit"))


def markdown(entries: list[dict], settings: dict) -> str:
    lines = ["# Speculative decoding against greedy decoding on the same backend\n",
             f"Prompts: {settings['repetitive']} repetitive + {settings['plain']} plain ({settings['data']}), "
             f"{settings['max_tokens']} tokens each, greedy; {settings['single']} repetitive prompts also one at a "
             f"time. Graphs: {settings['graphs']}. Identical: the speculative run's tokens equal greedy decoding's; "
             f"rebatched greedy identical: the control, greedy decoding run again in other batches (reverse order, "
             f"two halves), no speculation. Passed: speculation diverges no more often than the control, within "
             f"three standard deviations (batch groups, and the single runs against the batch run). Explained: the "
             f"speculative token is the reference's runner-up within {settings['near_tie']} nats. Judge: continuation "
             f"tokens a non-speculative engine, teacher-forced on the same prefix, ranks more than "
             f"{settings.get('judge_margin')} nats below its own top token, for greedy's outputs (its noise) and "
             f"the method's.\n"]
    cols = ["KV cache", "method", "prompts", "identical", "rebatched greedy identical",
            "judge: tokens over the margin, greedy / speculative (of)", "explained", "unexplained", "acceptance",
            "speed-up batch", "speed-up 1-at-a-time", "FULL-graph steps (>= 256 tokens)", "result"]
    lines += ["| " + " | ".join(cols) + " |", "| --- " * len(cols) + "|"]
    for e in entries:
        if e.get("error"):
            what = "refused at startup" if e.get("refused_at_startup") else "failed"
            err = str(e["error"]).replace("|", "\\|").replace("\n", " ")[:300]
            lines.append(f"| {e['kv']} | {e['method']} | | | | | | | | | | | **{what}**: {err} |")
            continue
        acc = f"{e['acceptance_rate']:.1%}" if e.get("acceptance_rate") is not None else ""
        judged = (f"{e['judge_over_greedy']} / {e['judge_over_speculative']} ({e['judge_positions']})"
                  if e.get("judge_positions") is not None else "")
        lines.append(f"| {e['kv']} | {e['method']} | {e['prompts']} | {e['identical']} | {e['control_identical']} | "
                     f"{judged} | {e['explained_near_ties']} | "
                     f"{e['unexplained']} | {acc} | {engine_rows.fmt(e['speedup_batch'], '.2f')} | "
                     f"{engine_rows.fmt(e['speedup_single'], '.2f')} | {e['full_graph_steps']} "
                     f"({e['full_graph_steps_dense_size']}) | {'passed' if e['passed'] else '**FAILED**'} |")
    runs: dict[tuple, list[str]] = {}  # rows merged from several runs: each run's command and commit
    for e in entries:
        runs.setdefault((e.get("command"), e.get("commit")), []).append(f"{e['kv']} {e['method']}")
    lines += ["", "Rows by run:", ""]
    lines += [f"- {', '.join(rows)}: `{command}` at commit {commit}" for (command, commit), rows in runs.items()]
    return "\n".join(lines) + "\n\n" + common.not_on_hopper_markdown()


def merged_entries(path: Path, entries: list[dict]) -> list[dict]:
    """The detailed results at path with entries in (an entry replaces the one of its kv and method)."""
    old = json.loads(path.read_text()).get("entries", []) if path.exists() else []
    doc = sc.merge_summary({"spec_decode": old}, "spec_decode", entries)
    return doc["spec_decode"]


def run(args: argparse.Namespace, command: str, write: bool = True) -> list[dict]:
    """Every KV cache's reference and methods, the results written after each KV cache when `write`."""
    log_dir = args.logs or Path(tempfile.mkdtemp(prefix="tq-spec-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    sources = sc.read_sources(args.data)
    groups = sc.spec_prompt_set(sources, args.repetitive, args.plain, seed=args.seed)
    prompts_file = log_dir / "prompts.json"
    prompts_file.write_text(json.dumps(groups))
    out = common.with_ext(common.stem_of(args.out), ".json")
    settings = dict(repetitive=args.repetitive, plain=args.plain, max_tokens=args.max_tokens, single=args.single,
                    data=str(args.data), near_tie=args.near_tie, judge_margin=args.judge_margin,
                    graphs=f"compilation_config {FAST_GRAPHS}" if args.fast_graphs else "vLLM's default compilation",
                    num_speculative_tokens=args.num_speculative_tokens, prompt_lookup_min=args.prompt_lookup_min,
                    prompt_lookup_max=args.prompt_lookup_max, logs=str(log_dir))
    meta = common.provenance(command)
    done: list[dict] = []
    for kv in args.kv_list:
        reference = run_case(case_spec(kv, None, args, prompts_file), log_dir, args.timeout)
        ran = {}
        for method in args.method_list:
            ran[method] = run_case(case_spec(kv, method, args, prompts_file), log_dir, args.timeout)
        judged = {} if args.no_judge else judge(kv, reference, ran, args, log_dir)
        for method, speculative in ran.items():
            entry = evaluate(kv, method, reference, speculative, args)
            entry.update(judge_entry(judged, method, args.judge_margin), command=command,
                         gpu=common.gpu_info()["name"], commit=common.git_commit())
            done.append(entry)
            print(json.dumps(summary_entry(entry, command)), flush=True)
        if write:
            entries = merged_entries(out, done)
            common.write_json(out, dict(settings=settings, entries=entries), meta)
            common.write_markdown(common.with_ext(common.stem_of(out), ".md"), markdown(entries, settings), meta)
            sc.write_summary(args.summary, "spec_decode", [summary_entry(e, command) for e in done], meta)
            print(f"wrote {out} and {args.summary}", flush=True)
    return done


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child)
    why = sc.missing_model(args.model) or (sc.missing_text_data() if args.data is None else None)
    if why:
        sys.exit(f"{NAME}: {why}")
    entries = run(args, common.command_line(NAME, argv))
    return 0 if entries and all(e["passed"] for e in entries) else 1


if __name__ == "__main__":
    sys.exit(main())
