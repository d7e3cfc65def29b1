"""The soak benchmark (benchmarks.serving_soak, whose short run is test_gpu_soak) on the CPU: its arguments, its
`vllm bench serve` command read by vLLM's own parser, vLLM's result JSON into rows, the memory summary, the soak.json
merge, the prompt sets from text, and the whole run against the stand-in server (fake_vllm) with vLLM's real benchmark
client, in this process."""

from __future__ import annotations

import json
import random
import sys

import pytest

from benchmarks import serving_common as srv
from benchmarks import serving_soak as soak
from tests.serving import fake_vllm

# A `vllm bench serve --save-result --metric-percentiles 50,90,99 --percentile-metrics ttft,tpot,itl,e2el
# --metadata kv=tq4 kv_tokens=16384` result as vLLM 0.25 writes it (vllm/benchmarks/serve.py: main_async's
# result_json, benchmark()'s result and process_one_metric's keys), without --save-detailed's per-request lists.
BENCH_SAMPLE = {
    "date": "20261126-061905", "endpoint_type": "openai", "backend": "openai", "label": "tq4",
    "model_id": "/tmp/smollm2", "tokenizer_id": "/tmp/smollm2", "num_prompts": 2000, "kv": "tq4",
    "kv_tokens": "16384", "request_rate": "inf", "burstiness": 1.0, "max_concurrency": 64,
    "duration": 95.2, "completed": 1998, "failed": 2, "total_input_tokens": 452311, "total_output_tokens": 341876,
    "request_throughput": 20.99, "request_goodput": None, "output_throughput": 3591.1,
    "total_token_throughput": 8342.2, "max_output_tokens_per_s": 4410.0, "max_concurrent_requests": 64, "rtfx": 0.0,
    "mean_ttft_ms": 180.2, "median_ttft_ms": 95.1, "std_ttft_ms": 220.3, "p50_ttft_ms": 95.1, "p90_ttft_ms": 410.7,
    "p99_ttft_ms": 1210.4, "mean_tpot_ms": 14.2, "median_tpot_ms": 13.8, "std_tpot_ms": 3.1, "p50_tpot_ms": 13.8,
    "p90_tpot_ms": 18.2, "p99_tpot_ms": 25.9, "mean_itl_ms": 14.0, "median_itl_ms": 12.9, "std_itl_ms": 9.7,
    "p50_itl_ms": 12.9, "p90_itl_ms": 21.5, "p99_itl_ms": 61.3, "mean_e2el_ms": 2600.0, "median_e2el_ms": 2100.0,
    "std_e2el_ms": 1700.0, "p50_e2el_ms": 2100.0, "p90_e2el_ms": 4900.0, "p99_e2el_ms": 8100.0,
}


def test_arguments():
    a = soak.parse_args(["--model", "/m"])
    assert (a.requests, a.concurrency, a.kv_tokens, a.kv_list) == (2000, 64, 8192, ["tq4", "tq3", "bf16"])
    q = soak.parse_args(["--model", "/m", "--quick", "--requests", "150", "--answer-words", "4,9"])
    assert (q.requests, q.kv_tokens, q.answer_words, q.prompt_words) == (150, 6144, (4, 9), (16, 400))
    for bad in (["--kv", "fp8"], ["--requests", "0"], ["--answer-words", "9,4"], ["--warmup-fraction", "1"],
                ["--kv-tokens", "4000"]):
        with pytest.raises(SystemExit):
            soak.parse_args(["--model", "/m", *bad])
    assert soak.serve_extra(a) == ("--block-size", "16", "--num-gpu-blocks-override", "512")
    assert soak.kv_blocks(1000) == 63


def test_bench_command_is_read_by_vllms_parser(tmp_path):
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = soak.parse_args(["--model", "/m", "--requests", "77", "--concurrency", "9", "--bench-arg=--num-warmups=2"])
    cmd = soak.bench_command(args, "tq3", "http://127.0.0.1:1234", "/m", tmp_path / "p.json", tmp_path)
    assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    b = parser.parse_args(cmd[5:])
    assert (b.backend, b.base_url, b.endpoint, b.model, b.dataset_name) == (
        "openai", "http://127.0.0.1:1234", "/v1/completions", "/m", "sharegpt")
    assert (b.num_prompts, b.max_concurrency, b.request_rate, b.ignore_eos, b.temperature) == (77, 9, float("inf"),
                                                                                               True, 0.0)
    assert (b.percentile_metrics, b.metric_percentiles) == ("ttft,tpot,itl,e2el", "50,90,99")
    assert b.save_result and b.save_detailed and b.result_filename == "tq3.json" and b.num_warmups == 2
    assert b.metadata == ["kv=tq3", "kv_tokens=8192"] and b.dataset_path == str(tmp_path / "p.json")
    args.dataset = "random"
    r = parser.parse_args(soak.bench_command(args, "bf16", "http://h:1", "/m", None, tmp_path)[5:])
    assert (r.dataset_name, r.random_input_len, r.random_output_len, r.random_range_ratio) == ("random", 512, 128,
                                                                                              "0.9")
    args.dataset = "text"
    with pytest.raises(ValueError):
        soak.bench_command(args, "tq4", "http://h:1", "/m", None, tmp_path)


def test_bench_row_and_compact_json():
    row = soak.bench_row("tq4", BENCH_SAMPLE)
    assert {k: row[k] for k in ("kv", "requests", "failed", "ttft_p99_ms", "tpot_p50_ms", "output_tok_s")} == dict(
        kv="tq4", requests=2000, failed=2, ttft_p99_ms=1210.4, tpot_p50_ms=13.8, output_tok_s=3591.1)
    assert (row["itl_p99_ms"], row["e2el_p90_ms"], row["completed"], row["max_concurrency"]) == (61.3, 4900.0, 1998,
                                                                                                 64)
    older = {k: v for k, v in BENCH_SAMPLE.items() if not k.startswith("p50_") and k != "failed"}
    fallback = soak.bench_row("tq4", older)  # 50th percentiles from median_*, failed from the counts
    assert fallback["tpot_p50_ms"] == 13.8 and fallback["failed"] == 2 and fallback["ttft_p90_ms"] == 410.7
    detailed = dict(BENCH_SAMPLE, ttfts=[0.1] * 3, itls=[[0.01]] * 3, errors=["", "boom " * 200, "boom " * 200],
                    generated_texts=["a", "b", "c"], input_lens=[1, 2, 3], output_lens=[3, 2, 1], start_times=[0] * 3)
    compact = soak.compact_bench(detailed)
    assert not set(soak.PER_REQUEST) & set(compact) and compact["p99_itl_ms"] == 61.3
    assert compact["error_count"] == 2 and len(compact["distinct_errors"]) == 1


def test_memory_summary():
    # idle for 10 samples (the client starting), then a step up as the load begins (inside the warm-up), then flat
    flat = [dict(t=i, gpu_mib=1000.0 + (300 if i >= 11 else 0), kv_usage=0.5 if i >= 10 else 0.0,
                 running=3 if i >= 10 else 0, waiting=1) for i in range(30)]
    s = soak.memory_summary(flat, 0.2, 64)
    assert s["flat"] and s["growth_after_warmup_mib"] == 0 and s["max_mib"] == 1300 and s["max_waiting"] == 1
    assert s["after_warmup_mib"] == 1300 and s["start_mib"] == 1000
    growing = [dict(t=i, gpu_mib=1000.0 + 50 * i) for i in range(10)]
    g = soak.memory_summary(growing, 0.2, 64)
    assert not g["flat"] and g["growth_after_warmup_mib"] == 350 and g["end_mib"] == 1450
    none = soak.memory_summary([dict(t=0, gpu_mib=None)], 0.2, 64)
    assert none["flat"] is None and none["memory_samples"] == 0 and none["samples"] == 1


def test_summary_merge_keeps_the_other_part(tmp_path):
    path = tmp_path / "soak.json"
    srv.write_summary(path, "spec_decode", [dict(kv="tq4", method="ngram", identical=200)], {"c": 1})
    srv.write_summary(path, "rows", [dict(kv="bf16", failed=0), dict(kv="tq4", failed=0)], {"c": 2})
    doc = srv.write_summary(path, "rows", [dict(kv="tq4", failed=3)], {"c": 3})
    assert [(r["kv"], r["failed"]) for r in doc["rows"]] == [("tq4", 3), ("bf16", 0)]  # replaced, kept, ordered
    assert doc["spec_decode"] == [dict(kv="tq4", method="ngram", identical=200)]
    assert doc["meta"] == {"spec_decode": {"c": 1}, "rows": {"c": 3}}
    assert json.loads(path.read_text()) == doc and not list(tmp_path.glob(".*.tmp"))
    doc = srv.write_summary(path, "spec_decode", [dict(kv="tq4", method="draft_model", identical=1)])
    assert [e["method"] for e in doc["spec_decode"]] == ["draft_model", "ngram"] and len(doc["rows"]) == 2
    with pytest.raises(ValueError):
        srv.merge_summary(doc, "spec_decode", [dict(kv="tq4")])
    with pytest.raises(ValueError):
        srv.merge_summary(doc, "other", [])


def test_text_sources_and_prompt_sets(tmp_path):
    (tmp_path / "paul_graham_essays").mkdir()
    (tmp_path / "paul_graham_essays" / "a.txt").write_text("First essay. " * 300)
    (tmp_path / "books" / "x").mkdir(parents=True)
    (tmp_path / "books" / "x" / "b.txt").write_text(
        "The Project Gutenberg EBook licence\r\n*** START OF THIS PROJECT GUTENBERG EBOOK B ***\r\n"
        + "Book words here. " * 400 + "\r\n*** END OF THIS PROJECT GUTENBERG EBOOK B ***\r\nlicence text\r\n")
    (tmp_path / "wikitext2-test.txt").write_text(
        " \n = Alpha = \n \n Alpha is a 1 @,@ 000 @-@ year old thing . \n = = History = = \n It ran . \n"
        " = Beta = \n Beta text here . \n")
    sources = srv.read_sources(tmp_path)
    assert sources["wikitext"] == ["Alpha is a 1,000-year old thing . It ran .", "Beta text here ."]
    assert "licence" not in sources["books"][0] and sources["books"][0].count("Book words here.") == 400
    rows = srv.soak_prompt_set(sources, 50, seed=1, prompt_words=(5, 40), answer_words=(3, 9),
                                        median_prompt_words=10, median_answer_words=5)
    assert len(rows) == 50 and all(5 <= len(r["prompt"].split()) <= 40 and 3 <= len(r["answer"].split()) <= 9
                                   for r in rows)
    assert rows == srv.soak_prompt_set(sources, 50, seed=1, prompt_words=(5, 40), answer_words=(3, 9),
                                                median_prompt_words=10, median_answer_words=5)  # deterministic
    assert sum(r["prompt"].startswith(("First", "Book")) for r in rows) >= 40  # passages start at a sentence
    doc = json.loads(srv.write_sharegpt(tmp_path / "p.json", rows).read_text())
    assert doc[3]["conversations"] == [{"from": "human", "value": rows[3]["prompt"]},
                                       {"from": "gpt", "value": rows[3]["answer"]}]
    with pytest.raises(FileNotFoundError):
        srv.read_sources(tmp_path / "none")
    with pytest.raises(ValueError):
        srv.Passages({"s": ["too short"]}).take(50)


def run_bench_in_process(cmd, env, log_stem, timeout):
    """`vllm bench serve` as the soak runs it, in this process (no second vLLM import): the same parser and main."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    main(parser.parse_args(cmd[5:]))
    return 0


@pytest.fixture
def fake_soak(tmp_path, monkeypatch):
    """A soak run's arguments, its text (an essay of random sentences: the stand-in's answers ignore it) and a
    stand-in server (tokenizer, a 300-token KV budget) per KV cache."""
    rng = random.Random(0)
    essay = tmp_path / "text" / "paul_graham_essays" / "essay.txt"
    essay.parent.mkdir(parents=True)
    essay.write_text(" ".join(" ".join(rng.choices(fake_vllm.WORDS, k=rng.randint(4, 12))) + "." for _ in range(300)))
    model = tmp_path / "model"
    fake_vllm.write_tokenizer(model)
    httpds = []

    def server_for(kv):
        httpd, port = fake_vllm.serve(str(model), kv_tokens=300)
        httpds.append(httpd)
        server = srv.Server(kv, str(model), None, None, tmp_path / "logs")
        server.port = port
        return server

    monkeypatch.setattr(soak, "nvidia_smi_memory_mib", lambda: 2048.0)  # flat GPU memory
    args = soak.parse_args([
        "--model", str(model), "--data", str(essay.parents[1]), "--kv", "tq4,bf16", "--requests", "16",
        "--concurrency", "8",
        "--prompt-words", "4,12", "--median-prompt-words", "6", "--answer-words", "2,6", "--median-answer-words", "3",
        "--sample-interval", "0.1", "--logs", str(tmp_path / "logs"), "--out", str(tmp_path / "out" / "cpu-soak"),
        "--summary", str(tmp_path / "out" / "soak.json")])
    yield args, server_for
    for httpd in httpds:
        httpd.shutdown()
        httpd.server_close()


def test_soak_against_the_stand_in_server(fake_soak, tmp_path, monkeypatch):
    args, server_for = fake_soak
    srv.write_summary(args.summary, "spec_decode", [dict(kv="tq4", method="ngram", identical=256)])
    real = fake_vllm.choices_for
    calls = {"n": 0}

    def sometimes_500(state, body, chat):  # bf16's server fails its 5th benchmark request
        if body.get("stream") and state.model and calls.setdefault("kv", None) == "bf16":
            calls["n"] += 1
            if calls["n"] == 5:
                raise fake_vllm.Invalid(500, "engine dead")
        return real(state, body, chat)

    def server_and_mark(kv):
        calls["kv"] = kv
        return server_for(kv)

    monkeypatch.setattr(fake_vllm, "choices_for", sometimes_500)
    rows = soak.run(args, "python -m benchmarks serving_soak --quick", server_and_mark, run_bench_in_process)
    tq4, bf16 = rows
    assert tq4["passed"], {k: tq4.get(k) for k in ("checks", "error")}
    assert (tq4["requests"], tq4["failed"], tq4["completed"]) == (16, 0, 16) and tq4["preemptions"] > 0
    assert tq4["ttft_p99_ms"] > 0 and tq4["tpot_p50_ms"] > 0 and tq4["output_tok_s"] > 0
    assert tq4["greedy_after_soak"]["identical"] == len(srv.PROMPTS) and tq4["checks"]["memory_flat"]
    assert tq4["memory"]["max_running"] >= 1 and tq4["serve_command"].endswith("--num-gpu-blocks-override 512")
    assert bf16["failed"] == 1 and not bf16["passed"] and bf16["checks"]["zero_failed"] is False
    bench = json.loads((tmp_path / "out" / "cpu-soak" / "tq4.json").read_text())
    assert set(BENCH_SAMPLE) <= set(bench), set(BENCH_SAMPLE) - set(bench)  # the sample's keys are vLLM's
    assert not set(soak.PER_REQUEST) & set(bench)
    bf16_bench = json.loads((tmp_path / "out" / "cpu-soak" / "bf16.json").read_text())
    assert bf16_bench["error_count"] == 1 and bf16_bench["distinct_errors"] == ["Internal Server Error"]
    doc = json.loads(args.summary.read_text())
    assert [r["kv"] for r in doc["rows"]] == ["tq4", "bf16"] and doc["spec_decode"][0]["identical"] == 256
    for r in doc["rows"]:
        assert {"kv", "requests", "failed", "preemptions", "ttft_p99_ms", "tpot_p50_ms", "output_tok_s"} <= set(r)
    assert doc["meta"]["rows"]["command"] == "python -m benchmarks serving_soak --quick"
    md = (tmp_path / "out" / "cpu-soak.md").read_text()
    assert "| tq4 | 16 | 0 |" in md and "**FAILED** zero_failed" in md and "vllm.entrypoints.cli.main bench serve" in md
    assert (tmp_path / "out" / "cpu-soak.png").stat().st_size > 10000


def test_a_server_that_does_not_start_is_a_failed_row(fake_soak, monkeypatch):
    args, _ = fake_soak
    args.kv_list = ["tq3"]

    def no_server(kv):
        raise RuntimeError("tq3: server exited with status 1 before /health answered")

    (row,) = soak.run(args, "cmd", no_server, run_bench_in_process, write=False)  # as the GPU test runs it
    assert not row["passed"] and "server did not start" in row["error"] and row["failed"] is None
    assert not args.summary.exists() and not args.out.with_suffix(".md").exists()
    soak.run(args, "cmd", no_server, run_bench_in_process)
    assert json.loads(args.summary.read_text())["rows"][0]["kv"] == "tq3"
