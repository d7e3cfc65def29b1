"""The speculative-decoding benchmark (benchmarks.serving_spec_decode, whose quick run is test_gpu_spec_decode) on the
CPU: its arguments and vLLM configs (checked by
vLLM's own EngineArgs / SpeculativeConfig), the Prometheus and CUDA-graph log parsing (samples in vLLM's formats),
the comparisons, the engine-side runs on a stand-in LLM, and the parent's whole flow with the engines' processes
replaced by stand-in LLMs in this process."""

from __future__ import annotations

import importlib.util
import json
import zlib
from pathlib import Path

import pytest

from benchmarks import engine_rows
from benchmarks import serving_common as sc
from benchmarks import serving_spec_decode as spec

DATA = sc.text_data_dir()  # WikiText-2, essays, books: sc.missing_text_data() says where to get them

# /metrics of a vLLM 0.25 engine pair with speculative decoding (prometheus_client's exposition: counters as
# <name>_total plus <name>_created, per-position counters labelled by position).
METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/tmp/smollm2"} 100.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="/tmp/smollm2"} 20.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="/tmp/smollm2"} 1.7641e+09
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/tmp/smollm2"} 300.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="/tmp/smollm2"} 60.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/tmp/smollm2"} 150.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="/tmp/smollm2"} 30.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/tmp/smollm2",position="0"} 80.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/tmp/smollm2",position="1"} 45.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/tmp/smollm2",position="2"} 25.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="/tmp/smollm2",position="0"} 30.0
vllm:num_preemptions_total{engine="0",model_name="/tmp/smollm2"} 3.0
"""


def test_arguments_default_quick_and_refused(monkeypatch):
    real_find = importlib.util.find_spec
    a = spec.parse_args(["--model", "/m", "--data", "/d"])
    assert a.kv_list == ["tq4", "tq3", "bf16", "fp8"]
    assert a.method_list == ["ngram" if real_find("numba") else "ngram_gpu"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "numba" else real_find(name))
    assert spec.parse_args(["--model", "/m", "--methods", "auto,draft_model"]).method_list == ["ngram_gpu",
                                                                                             "draft_model"]
    monkeypatch.undo()
    assert (a.repetitive, a.plain, a.max_tokens, a.single) == (128, 128, 128, 8) and not a.fast_graphs
    q = spec.parse_args(["--model", "/m", "--quick", "--kv", "tq3", "--no-control", "--methods", "ngram,draft_model",
                         "--max-tokens", "40"])
    assert q.kv_list == ["tq3"] and q.method_list == ["ngram", "draft_model"] and q.fast_graphs
    assert (q.repetitive + q.plain, q.max_tokens) == (200, 40)  # --quick still compares >= 200 prompts
    for bad in (["--kv", "int8"], ["--methods", "eagle"], ["--single", "500"], ["--prompt-lookup-min", "6"],
                ["--max-tokens", "1"]):
        with pytest.raises(SystemExit):
            spec.parse_args(["--model", "/m", *bad])


def test_engine_and_speculative_configs_are_vllms():
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    args = spec.parse_args(["--model", "/m", "--quick", "--num-speculative-tokens", "4"])
    for method in ("ngram", "ngram_gpu"):
        cfg = SpeculativeConfig(**spec.speculative_config(method, args))  # unknown keys would raise
        assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (
            method, 4, 2, 5)
    assert spec.speculative_config("draft_model", args)["model"] == "/m"
    ref = spec.engine_kwargs(spec.case_spec("tq4", None, args, Path("/p.json")))
    ngram = spec.engine_kwargs(spec.case_spec("bf16", "ngram", args, Path("/p.json")))
    fp8 = spec.engine_kwargs(spec.case_spec("fp8", "ngram", args, Path("/p.json")))
    assert "speculative_config" not in ref and ngram["speculative_config"]["method"] == "ngram"
    assert (ref["kv_cache_dtype"], ngram["kv_cache_dtype"], fp8["kv_cache_dtype"]) == ("auto", "auto", "fp8")
    assert fp8["attention_config"] == {"backend": "FLASH_ATTN"}
    assert ref["attention_config"] == {"backend": "CUSTOM"} and ngram["attention_config"] == {"backend": "FLASH_ATTN"}
    for kw in (ref, ngram, fp8):
        e = EngineArgs(**kw)  # every key an engine argument
        assert e.cudagraph_metrics and not e.disable_log_stats and not e.enable_prefix_caching
        assert e.compilation_config.cudagraph_mode.name == "FULL_DECODE_ONLY"
    full = spec.engine_kwargs(spec.case_spec("tq4", "ngram", spec.parse_args(["--model", "/m"]), Path("/p.json")))
    assert "compilation_config" not in full  # vLLM's default compilation and graphs


def test_dense_threshold_is_the_builders():
    from turboquant_vllm.vllm.metadata import DENSE_PREFILL_MIN_TOKENS

    assert spec.DENSE_PREFILL_MIN_TOKENS == DENSE_PREFILL_MIN_TOKENS


def test_spec_counters_and_acceptance():
    counts = spec.spec_counts(METRICS)
    assert (counts["drafts"], counts["draft_tokens"], counts["accepted_tokens"]) == (120, 360, 180)
    assert counts["accepted_per_pos"] == {0: 110, 1: 45, 2: 25}
    zero = spec.spec_counts("")
    assert zero["drafts"] == 0 and zero["accepted_per_pos"] == {}
    acc = spec.acceptance(zero, counts)
    assert acc["acceptance_rate"] == pytest.approx(0.5) and acc["mean_acceptance_length"] == pytest.approx(2.5)
    assert acc["per_position_rate"] == pytest.approx([110 / 120, 45 / 120, 25 / 120])
    assert spec.acceptance(counts, counts)["acceptance_rate"] is None  # nothing drafted in between
    both = spec.sum_acceptance([acc, spec.acceptance(zero, dict(zero, drafts=10, draft_tokens=40,
                                                                accepted_tokens=0, accepted_per_pos={}))])
    assert both["acceptance_rate"] == pytest.approx(180 / 400)
    assert sc.counter(METRICS, "vllm:num_preemptions_total") == 3


def test_cudagraph_steps_from_vllms_table():
    from vllm.compilation.cuda_graph import CUDAGraphLogging, CUDAGraphStat
    from vllm.config.compilation import CUDAGraphMode

    log = CUDAGraphLogging(CUDAGraphMode.FULL_AND_PIECEWISE, [1, 2, 4, 256, 512])
    for stat, n in ((CUDAGraphStat(250, 256, 6, "FULL"), 3), (CUDAGraphStat(510, 512, 2, "FULL"), 2),
                    (CUDAGraphStat(30, 32, 2, "FULL"), 4), (CUDAGraphStat(300, 304, 4, "PIECEWISE"), 1),
                    (CUDAGraphStat(900, 900, 0, "NONE"), 5)):
        for _ in range(n):
            log.observe(stat)
    text = "INFO 11-26 [loggers.py:273] " + log.generate_metric_table() + "\nsome other line | 1 | 2 |\n"
    steps = spec.cudagraph_steps(text + text)  # two intervals logged
    assert steps == dict(by_mode={"FULL": 18, "PIECEWISE": 2, "NONE": 10}, full_steps_dense_size=10)


def test_compare_outputs():
    ref = dict(tokens=[[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1], [2, 2, 2]],
               runner_up=[[9, 9, 9], [9, 50, 9], [9, 80, 9], [3, 3], [5, 5, 5]],
               margin=[[1.0] * 3, [1.0, 0.05, 1.0], [1.0, 2.5, 1.0], [1.0, 1.0], [0.1, 0.1, 0.1]])
    got = dict(tokens=[[1, 2, 3], [4, 50, 6], [7, 80, 9], [1, 1, 1], [2, 2, 7]])
    c = spec.compare_outputs(ref, got, near_tie=0.3)
    assert (c["prompts"], c["identical"], c["explained"], c["unexplained"]) == (5, 1, 1, 3)
    by_prompt = {d["prompt"]: d for d in c["divergences"]}
    assert by_prompt[1]["explained"] and by_prompt[1]["position"] == 1 and by_prompt[1]["margin"] == 0.05
    assert not by_prompt[2]["explained"]  # the runner-up, but far from a tie
    assert by_prompt[3]["reference"] is None and not by_prompt[3]["explained"]  # longer than the reference
    assert not by_prompt[4]["explained"]  # within the margin, but not the runner-up
    assert spec.compare_outputs(ref, dict(tokens=ref["tokens"]), 0.3)["identical"] == 5
    with pytest.raises(ValueError):
        spec.compare_outputs(ref, dict(tokens=ref["tokens"][:2]), 0.3)


# ---- a stand-in LLM: greedy tokens from the prompt; the speculative one may flip chosen positions --------------

class _Out:
    def __init__(self, token_ids, logprobs):
        self.token_ids, self.logprobs = token_ids, logprobs


class _Request:
    def __init__(self, token_ids, logprobs, prompt_token_ids=(), prompt_logprobs=None):
        self.outputs = [_Out(token_ids, logprobs)]
        self.prompt_token_ids, self.prompt_logprobs = list(prompt_token_ids), prompt_logprobs


class StandInLLM:
    """greedy(prompt)[i] = crc32(prompt) + i, runner-up that + 1000, margin 0.05 at even positions, 2.0 at odd
    ones; `flips` {(prompt index, position)} makes this engine take the runner-up there (and then go on from it);
    `rebatch_flips` the same, only in batches of other sizes than the whole group's (the rebatched pass)."""

    def __init__(self, prompts: list[str], flips=(), spec_counts: dict | None = None, rebatch_flips=(),
                 group_sizes=()):
        self.index = {p: i for i, p in enumerate(prompts)}
        self.flips = set(flips)
        self.rebatch_flips, self.group_sizes = set(rebatch_flips), set(group_sizes)
        self.calls: list[int] = []
        self.counters = spec_counts

    def generate(self, prompts, params, use_tqdm=False):
        from vllm.logprobs import Logprob

        assert params.temperature == 0.0 and params.ignore_eos and not use_tqdm
        self.calls.append(len(prompts))
        if self.counters is not None:  # every batch drafts 3 tokens a prompt, accepts 2
            self.counters.update(drafts=self.counters["drafts"] + len(prompts),
                                 draft_tokens=self.counters["draft_tokens"] + 3 * len(prompts),
                                 accepted=self.counters["accepted"] + 2 * len(prompts))
        rebatched = len(prompts) > 1 and len(prompts) not in self.group_sizes
        flips = self.flips | (self.rebatch_flips if rebatched else set())
        if params.prompt_logprobs:  # the judge: a flipped token (>= 500000) ranks 2 nats below its greedy one
            from vllm.logprobs import Logprob

            assert params.max_tokens == 1 and all(isinstance(p, dict) for p in prompts)
            return [_Request([0], None, p["prompt_token_ids"], [None] + [
                {t: Logprob(-2.1, 2), t - 500000: Logprob(-0.1, 1)} if t >= 500000 else {t: Logprob(-0.1, 1)}
                for t in p["prompt_token_ids"][1:]]) for p in prompts]
        outs = []
        for p in prompts:
            base, i = zlib.crc32(p.encode()) % 100000, self.index.get(p, -1)
            toks, lps = [], []
            for pos in range(params.max_tokens):
                greedy = base + pos + (7 if toks and toks[-1] >= 500000 else 0)
                tok = greedy + 500000 if (i, pos) in flips else greedy
                toks.append(tok)
                margin = 0.05 if pos % 2 == 0 else 2.0
                lps.append({tok: Logprob(-0.1, 1), tok + 500000: Logprob(-0.1 - margin, 2)})
            outs.append(_Request(toks, lps if params.logprobs else None, prompt_token_ids=[len(p), base]))
        return outs


def counters_text(c: dict) -> str:
    return (f'vllm:spec_decode_num_drafts_total{{engine="0"}} {c["drafts"]}\n'
            f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {c["draft_tokens"]}\n'
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {c["accepted"]}\n')


@pytest.fixture
def prompt_file(tmp_path):
    groups = {"repetitive": [{"prompt": f"again and again {i}"} for i in range(6)],
              "plain": [{"prompt": f"plain text {i}"} for i in range(5)]}
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(groups))
    return path, [p["prompt"] for g in groups.values() for p in g]


def test_run_engine_on_a_stand_in(prompt_file):
    path, prompts = prompt_file
    args = spec.parse_args(["--model", "/m", "--quick", "--single", "3", "--max-tokens", "6"])
    counters = dict(drafts=0, draft_tokens=0, accepted=0)
    llm = StandInLLM(prompts, spec_counts=counters)
    ref = spec.run_engine(llm, spec.case_spec("tq4", None, args, path), metrics_text=lambda: counters_text(counters))
    assert set(ref["groups"]) == {"repetitive", "plain", "single"}
    rep = ref["groups"]["repetitive"]
    assert len(rep["tokens"]) == 6 and all(len(t) == 6 for t in rep["tokens"])
    assert rep["logprobs_pass_same_tokens"] and rep["margin"][0][:2] == [0.05, 2.0]
    assert rep["runner_up"][0][0] == rep["tokens"][0][0] + 500000
    assert rep["spec"]["acceptance_rate"] == pytest.approx(2 / 3) and rep["spec"]["drafts"] == 6
    assert ref["groups"]["single"]["tokens"] == rep["tokens"][:3]
    assert rep["rebatched_tokens"] == rep["tokens"] and "rebatched_tokens" not in ref["groups"]["single"]
    # warm-ups (two batches), the timed batches, three single runs, the logprobs pass (two batches, three singles),
    # the rebatched pass (each group in two halves)
    assert llm.calls == [6, 5, 6, 5, 1, 1, 1, 6, 5, 1, 1, 1, 3, 3, 3, 2]
    flipped = StandInLLM(prompts, rebatch_flips={(0, 1)}, group_sizes={6, 5})
    again = spec.run_engine(flipped, spec.case_spec("tq4", None, args, path), lambda: "")["groups"]["repetitive"]
    assert again["tokens"][0] != again["rebatched_tokens"][0] and again["tokens"][1:] == again["rebatched_tokens"][1:]
    spec_case = spec.case_spec("tq4", "ngram", args, path)
    plain = spec.run_engine(StandInLLM(prompts), spec_case, lambda: "")["groups"]["plain"]
    assert "runner_up" not in plain and "rebatched_tokens" not in plain


def test_batch_invariant_runs_demand_identity(prompt_file, tmp_path, monkeypatch):
    """--batch-invariant: the children get VLLM_BATCH_INVARIANT=1, the methods their label, and one flip fails even
    where the rebatched control flips more."""
    path, prompts = prompt_file
    seen = []

    def run_child(cmd, env, log, timeout, tag):
        case = json.loads(Path(cmd[-1]).read_text())
        seen.append(env.get("VLLM_BATCH_INVARIANT"))
        llm = StandInLLM(prompts, {(0, 1)} if case["method"] and case["kv"] == "tq4" else (),
                         rebatch_flips={(i, 1) for i in range(4)}, group_sizes={6, 5})
        row = ({"judge": spec.judge_engine(llm, case)} if case.get("judge_file")
               else spec.run_engine(llm, case, metrics_text=lambda: ""))
        row.update(engine={"speculative_config": None}, startup_s=1.0)
        return spec.save_row(cmd[-1], row), spec.READY, None

    monkeypatch.setattr(engine_rows, "run_child", run_child)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    args = spec.parse_args(["--model", "/m", "--data", str(tmp_path), "--kv", "tq4", "--no-control", "--max-tokens",
                            "6", "--repetitive", "6", "--plain", "5", "--single", "3", "--batch-invariant",
                            "--logs", str(tmp_path / "logs"), "--out", str(tmp_path / "spec.json"),
                            "--summary", str(tmp_path / "soak.json")])
    monkeypatch.setattr(sc, "read_sources", lambda d: {})
    monkeypatch.setattr(sc, "spec_prompt_set", lambda *a, **k: json.loads(path.read_text()))
    (entry,) = spec.run(args, "python -m benchmarks serving_spec_decode --batch-invariant")
    assert seen == ["1", "1", "1"] and entry["method"] == f"{args.method_list[0]}, {spec.BATCH_INVARIANT_LABEL}"
    assert (entry["identical"], entry["control_identical"]) == (10, 7) and not entry["passed"]
    assert not spec.parse_args(["--model", "/m"]).batch_invariant


def test_within_rounding():
    assert spec.within_rounding(0, 0) and spec.within_rounding(9, 0) and not spec.within_rounding(10, 0)
    assert spec.within_rounding(97, 90) and spec.within_rounding(130, 90) and not spec.within_rounding(140, 90)
    assert spec.divergent([[1, 2], [3]], [[1, 2], [4]]) == 1


def test_the_whole_flow_with_stand_in_engines(prompt_file, tmp_path, monkeypatch):
    """run(): every case's process replaced by a stand-in engine in this process. tq4's speculative engine flips a
    confident token in every prompt, and so does its rebatched greedy run in all but one (passed: rounding);
    fp8's speculative engine flips every prompt, its rebatched run none (failed); bf16's flips one near tie
    (explained, passed); tq3's speculative engine is refused at startup."""
    path, prompts = prompt_file
    every = {(i, 1) for i in range(len(prompts))}
    flips = {"tq4": every, "fp8": every, "bf16": {(1, 4)}}
    rebatch_flips = {"tq4": {(i, 1) for i in range(len(prompts) - 1)}}

    def run_child(cmd, env, log, timeout, tag):
        case = json.loads(Path(cmd[-1]).read_text())
        assert tag == spec.TAG and cmd[-2] == "--child" and env.get("TURBOQUANT_PRESET") == case["preset"]
        if case["kv"] == "tq3" and case["method"]:
            return None, ("(EngineCore) ValueError: speculative decoding refused by a test\nValueError: again\n"
                          "ValueError: speculative decoding refused by a test\nRuntimeError: Engine core "
                          "initialization failed. See root cause above.\n"), "exit status 1"
        counters = dict(drafts=0, draft_tokens=0, accepted=0)
        llm = StandInLLM(prompts, flips.get(case["kv"], ()) if case["method"] else (), counters,
                         rebatch_flips=rebatch_flips.get(case["kv"], ()), group_sizes={6, 5})
        row = ({"judge": spec.judge_engine(llm, case)} if case.get("judge_file")
               else spec.run_engine(llm, case, metrics_text=lambda: counters_text(counters)))
        row.update(engine={"speculative_config": json.dumps(case["spec"])}, startup_s=1.0)
        table = "| 250 | 256 | 6 | FULL | 7 |\n| 12 | 16 | 4 | FULL | 2 |\n"
        return spec.save_row(cmd[-1], row), f"{spec.READY}\n{table}", None

    monkeypatch.setattr(engine_rows, "run_child", run_child)
    summary = tmp_path / "soak.json"
    sc.write_summary(summary, "rows", [{"kv": "tq4", "requests": 9}])  # the soak's part, kept
    args = spec.parse_args(["--model", "/m", "--data", str(tmp_path), "--kv", "tq4,tq3", "--max-tokens", "6",
                            "--repetitive", "6", "--plain", "5", "--single", "3",
                            "--logs", str(tmp_path / "logs"), "--out", str(tmp_path / "spec.json"),
                            "--summary", str(summary)])
    monkeypatch.setattr(sc, "read_sources", lambda d: {})
    monkeypatch.setattr(sc, "spec_prompt_set", lambda *a, **k: json.loads(path.read_text()))
    entries = spec.run(args, "python -m benchmarks serving_spec_decode ...")
    by_kv = {e["kv"]: e for e in entries}
    assert list(by_kv) == ["tq4", "tq3", "bf16", "fp8"]
    tq4, fp8 = by_kv["tq4"], by_kv["fp8"]
    assert (tq4["identical"], tq4["control_identical"], tq4["unexplained"]) == (0, 1, 11) and tq4["passed"]
    assert tq4["groups"]["single"]["control_identical"] == 3 and tq4["groups"]["single"]["identical"] == 0
    assert (fp8["identical"], fp8["control_identical"]) == (0, 11) and not fp8["passed"]
    # the judge: every flipped token ranks 2 nats below greedy's; greedy's own outputs never
    assert (tq4["judge_positions"], tq4["judge_over_greedy"], tq4["judge_over_speculative"]) == (66, 0, 11)
    assert (fp8["judge_over_speculative"], by_kv["bf16"]["judge_over_speculative"]) == (11, 1)
    assert by_kv["tq3"]["judge_positions"] is None  # its speculative engine never ran: no judge
    assert tq4["acceptance_rate"] == pytest.approx(2 / 3, abs=1e-4) and tq4["full_graph_steps"] == 9
    assert tq4["full_graph_steps_dense_size"] == 7 and tq4["speedup_batch"] > 0
    assert by_kv["tq3"]["refused_at_startup"] and by_kv["tq3"]["error"] == (
        "exit status 1: ValueError: speculative decoding refused by a test | ValueError: again | RuntimeError: Engine "
        "core initialization failed. See root cause above.")
    assert by_kv["tq3"]["identical"] is None and not by_kv["tq3"]["passed"] and by_kv["tq3"]["prompts"] == 11
    assert by_kv["bf16"]["explained_near_ties"] == 1 and by_kv["bf16"]["passed"]
    assert by_kv["bf16"]["control_identical"] == 11
    doc = json.loads(summary.read_text())
    assert doc["rows"] == [{"kv": "tq4", "requests": 9}]
    assert [(e["kv"], e["method"]) for e in doc["spec_decode"]] == [("tq4", "ngram"), ("tq3", "ngram"),
                                                                    ("bf16", "ngram"), ("fp8", "ngram")]
    assert set(spec.SUMMARY_KEYS) <= set(doc["spec_decode"][0]) and doc["meta"]["spec_decode"]["command"]
    detail = json.loads((tmp_path / "spec.json").read_text())
    assert detail["meta"]["command"].startswith("python -m benchmarks serving_spec_decode")
    assert len(detail["entries"]) == 4
    md = (tmp_path / "spec.md").read_text()
    assert "**FAILED**" in md and "refused at startup" in md
    assert "| bf16 | ngram | 11 | 10 | 11 | 0 / 1 (66) | 1 | 0 |" in md
    # rows merged from several runs name theirs
    assert "- tq4 ngram, tq3 ngram, bf16 ngram, fp8 ngram: `python -m benchmarks serving_spec_decode ...` at" in md


@pytest.mark.skipif(DATA is None, reason=str(sc.missing_text_data()))
def test_prompt_groups_make_ngram_drafts_possible():
    """The repetitive prompts repeat their passage (the n-grams speculation matches), the plain ones do not; the
    plain ones take every source of the real text in turn."""
    sources = sc.read_sources(DATA)
    groups = sc.spec_prompt_set(sources, 30, 20, seed=3)
    assert [len(g) for g in groups.values()] == [30, 20]
    for item in groups["repetitive"]:
        words = item["prompt"].split()
        tail = " ".join(words[-4:])
        assert " ".join(words).count(tail) >= 2, item  # the prompt's last words occurred before
    assert len({i["prompt"] for i in groups["plain"]}) == 20
    assert {i["source"] for i in groups["plain"]} == set(sources)
