"""benchmarks.awq without a GPU: the arguments, the children's command lines, their logs and the written results."""

import json
import sys

import pytest

from benchmarks import awq, common, engine_rows


def test_arguments_defaults():
    args = awq.BENCH.arguments([])
    assert args.method_list == ["awq_marlin", "awq_marlin:marlin", "awq_marlin:machete", "awq:triton", "awq_turbomind"]
    assert (args.prompts, args.input_len, args.output_len, args.layers) == (1000, 1024, 128, 32)
    assert args.gpu_memory_utilization == 0.85 and not args.merge and args.out is None and args.timeout == 0
    assert engine_rows.is_default_rows(args) and not engine_rows.is_default_rows(awq.BENCH.arguments(["--layers", "8"]))


def test_methods_are_canonical_and_checked():
    assert awq.BENCH.methods(" awq_marlin:Machete, awq_marlin:auto,awq_marlin,awq_turbomind,awq:linear-x ") == [
        "awq_marlin:machete", "awq_marlin", "awq_turbomind", "awq:linear_x"]
    assert awq.parse_method("awq_marlin") == ("awq_marlin", None)
    assert awq.parse_method("awq:triton") == ("awq", "triton")
    with pytest.raises(ValueError):
        awq.parse_method("awq_turbomind:marlin")  # ours has no --linear-backend
    for bad in (["--methods", "awq_turbomind:machete"], ["--methods", ","], ["--output-len", "1"]):
        with pytest.raises(SystemExit):
            awq.BENCH.arguments(bad)


def test_child_commands_per_method(tmp_path):
    args = awq.BENCH.arguments(["--prompts", "200", "--input-len", "512", "--output-len", "64", "--layers", "4",
                                "--gpu-memory-utilization", "0.8", "--timeout", "300", "--merge"])
    for spec in args.method_list:
        cmd = awq.BENCH.child_command(spec, tmp_path, args)
        assert cmd[:3] == [sys.executable, "-m", "benchmarks.awq"]
        assert cmd[-4:] == ["--checkpoint", str(tmp_path), "--child", spec]
        child = awq.BENCH.arguments(cmd[3:])  # the child reads back what the parent measures
        assert (child.child, child.checkpoint, child.prompts, child.input_len, child.output_len, child.layers,
                child.gpu_memory_utilization) == (spec, tmp_path, 200, 512, 64, 4, 0.8)
        assert not child.merge and child.out is None  # parent-only options stay with the parent


def test_engine_arguments_per_method():
    kw = {spec: awq.BENCH.llm_kwargs(*awq.parse_method(spec), "/m", 1024, 128, 0.85)
          for spec in awq.BENCH.methods(awq.METHODS)}
    assert {s: (k["quantization"], k.get("linear_backend")) for s, k in kw.items()} == {
        "awq_marlin": ("awq_marlin", None), "awq_marlin:marlin": ("awq_marlin", "marlin"),
        "awq_marlin:machete": ("awq_marlin", "machete"), "awq:triton": ("awq", "triton"),
        "awq_turbomind": ("awq_turbomind", None)}
    for spec, k in kw.items():
        assert k["dtype"] == "float16" and k["skip_tokenizer_init"] and not k["enable_prefix_caching"]
        assert k["max_model_len"] == 1024 + 128 + 8 and k["gpu_memory_utilization"] == 0.85
        assert "enforce_eager" not in k and "compilation_config" not in k  # vLLM's default: compiled, CUDA graphs
    from vllm.engine.arg_utils import EngineArgs

    assert EngineArgs(**kw["awq_marlin:machete"]).linear_backend == "machete"  # vLLM takes the keyword


def test_result_paths(tmp_path):
    stem, logs = awq.BENCH.result_paths(awq.BENCH.arguments([]), gpu="h100")
    assert stem == common.RESULTS / "awq" and logs == common.RESULTS / "awq" / "h100-llama3-8b-32l-1000x1024-128"
    stem, logs = awq.BENCH.result_paths(awq.BENCH.arguments(["--layers", "8", "--prompts", "100"]), gpu="h200")
    assert stem == logs == common.RESULTS / "awq" / "h200-llama3-8b-8l-100x1024-128"
    stem, logs = awq.BENCH.result_paths(awq.BENCH.arguments(["--out", str(tmp_path / "run.json")]))
    assert stem == logs == tmp_path / "run"


def test_model_shape_is_llama3_8b(tmp_path):
    from transformers import AutoConfig

    model = awq.model_config()
    assert model["num_hidden_layers"] == 32 and awq.model_config(4)["num_hidden_layers"] == 4
    assert awq.model_config(input_len=16384)["max_position_embeddings"] >= 16384 + 128
    (tmp_path / "config.json").write_text(json.dumps(model))
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert type(cfg).__name__ == "LlamaConfig"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.vocab_size) == (4096, 14336, 32, 8, 128, 128256)


def test_checkpoint_written_once_and_reused(tmp_path):
    tiny = dict(awq.MODEL, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=512)
    path = awq.ensure_checkpoint(tiny, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "awq" and config["quantization_config"]["group_size"] == 128
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert awq.ensure_checkpoint(tiny, path) == path and (path / "model.safetensors").stat().st_mtime_ns == stamp
    awq.ensure_checkpoint(dict(tiny, num_hidden_layers=2), path)  # another shape: written anew
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no scratch folder left


LOG = """INFO 11-26 02:00:00 [model.py:1] Resolved architecture: LlamaForCausalLM
(EngineCore pid=123) INFO 11-26 02:00:05 [auto_awq.py:473] Using MacheteLinearKernel for AutoAWQMarlinLinearMethod
(EngineCore pid=123) INFO 11-26 02:00:09 [gpu_model_runner.py:5307] Model loading took 5.44 GiB memory and 9.1 seconds
(EngineCore pid=123) INFO 11-26 02:00:40 [gpu_worker.py:539] Available KV cache memory: 58.31 GiB
"""


def test_log_facts():
    facts = awq.BENCH.log_facts(LOG)
    assert facts == dict(kernel="MacheteLinearKernel", weights_gib=5.44, kv_cache_gib=58.31, error=None)
    tm = awq.BENCH.log_facts("(EngineCore pid=1) INFO [method.py:150] awq_turbomind: AWQ int4, group 128, on the GEMM "
                             "kernels of turbomind 0.0.2 (fp16; bf16 activations cast at each layer)\n")
    assert tm["kernel"] == "turbomind 0.0.2" and tm["weights_gib"] is None
    both = awq.BENCH.log_facts(LOG + "WARNING Layer 'x' is not supported by AutoAWQMarlin. Falling back to "
                               "unoptimized AWQ kernels.\nUsing MacheteLinearKernel for AutoAWQMarlinLinearMethod\n")
    assert both["kernel"] == "MacheteLinearKernel + AutoAWQLinearMethod (Triton)"
    failed = awq.BENCH.log_facts(LOG + "Traceback (most recent call last):\nRuntimeError: engine core died\n"
                                 "ValueError: --linear-backend=machete was requested but no 'machete' kernel exists\n")
    assert failed["error"] == ("ValueError: --linear-backend=machete was requested but no 'machete' kernel exists")


def fake_child(tmp_path, code: str) -> list[str]:
    script = tmp_path / "child.py"
    script.write_text(code)
    return [sys.executable, str(script)]


def test_measure_a_row_a_failure_and_a_timeout(tmp_path):
    row = dict(method="awq_marlin", linear_backend="machete", label="awq_marlin:machete", output_tok_s=2000.0,
               decode_latency_ms=7.5, kv_cache_tokens=400000)
    ok = fake_child(tmp_path, f"import sys\nsys.stderr.write({LOG!r})\nprint('AWQ_ROW ' + {json.dumps(row)!r})\n")
    got = awq.BENCH.measure("awq_marlin:machete", ok, tmp_path / "logs" / "a.log", None, "cmd A")
    assert got["output_tok_s"] == 2000.0 and got["kernel"] == "MacheteLinearKernel" and got["weights_gib"] == 5.44
    assert got["command"] == "cmd A" and not got.get("error")
    assert "Using MacheteLinearKernel" in (tmp_path / "logs" / "a.log").read_text()

    bad = fake_child(tmp_path, "raise ValueError('no kernel for this layer')\n")
    got = awq.BENCH.measure("awq:triton", bad, tmp_path / "b.log", None, "cmd B")
    assert (got["method"], got["linear_backend"], got["output_tok_s"]) == ("awq", "triton", None)
    assert got["error"] == "exit status 1: ValueError: no kernel for this layer"

    slow = fake_child(tmp_path, "import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    got = awq.BENCH.measure("awq_turbomind", slow, tmp_path / "c.log", 1, "cmd C")
    assert got["error"] == "timed out after 1 s" and got["linear_backend"] == "auto"
    assert "started" in (tmp_path / "c.log").read_text()


def test_write_ratios_failed_rows_and_plot(tmp_path):
    rows = [dict(method="awq_marlin", linear_backend="auto", label="awq_marlin", kernel="MacheteLinearKernel",
                 output_tok_s=2000.0, decode_latency_ms=8.0, kv_cache_tokens=450000, weights_gib=5.44, command="run A"),
            dict(method="awq_marlin", linear_backend="marlin", label="awq_marlin:marlin", kernel="MarlinLinearKernel",
                 output_tok_s=2500.0, decode_latency_ms=10.0, kv_cache_tokens=450000, command="run A"),
            dict(method="awq", linear_backend="triton", label="awq:triton", kernel="TritonW4A16LinearKernel",
                 output_tok_s=None, decode_latency_ms=None, error="timed out after 300 s", command="run A"),
            dict(method="awq_turbomind", linear_backend="auto", label="awq_turbomind", kernel="turbomind 0.0.2",
                 output_tok_s=3000.0, decode_latency_ms=6.0, kv_cache_tokens=460000, cudagraph_mode="NONE",
                 command="run B")]
    settings = dict(prompts=1000, input_len=1024, output_len=128, gpu_memory_utilization=0.85, seed=0)
    meta = common.provenance("python -m benchmarks awq")
    awq.BENCH.write(rows, tmp_path / "awq", awq.model_config(), settings, meta)
    data = json.loads((tmp_path / "awq.json").read_text())
    assert data["meta"]["command"] == "python -m benchmarks awq" and data["meta"]["versions"]["torch"]
    assert data["meta"]["prompts"] == 1000 and data["meta"]["model"]["num_hidden_layers"] == 32
    got = {r["label"]: r for r in data["rows"]}
    for r in data["rows"]:
        assert {"method", "kernel", "output_tok_s", "decode_latency_ms"} <= set(r)
    # best vLLM throughput: Marlin's 2500; best vLLM decode: Machete's 8 ms
    assert got["awq_turbomind"]["output_tok_s_vs_best_vllm"] == pytest.approx(1.2)
    assert got["awq_turbomind"]["decode_speed_vs_best_vllm"] == pytest.approx(8 / 6)
    assert got["awq_marlin"]["output_tok_s_vs_best_vllm"] == pytest.approx(0.8)
    assert got["awq_marlin:marlin"]["decode_speed_vs_best_vllm"] == pytest.approx(0.8)
    assert got["awq:triton"]["output_tok_s_vs_best_vllm"] is None and got["awq:triton"]["error"]
    md = (tmp_path / "awq.md").read_text()
    assert md.startswith("<sub>`python -m benchmarks awq` at commit ")
    assert "| awq_turbomind | auto | turbomind 0.0.2 | 3,000 | 1.20x |  | 6.00 | 1.33x | none | 460,000 |  |" in md
    assert "| awq_marlin | auto | MacheteLinearKernel | 2,000 | 0.80x |  | 8.00 | 1.00x |  | 450,000 | 5.44 |" in md
    assert "| awq | triton | TritonW4A16LinearKernel **failed**: timed out after 300 s |  |  |  |  |  |  |  |" in md
    assert "best vLLM throughput: awq_marlin:marlin (MarlinLinearKernel)" in md
    assert "best vLLM batch-1 decode: awq_marlin (MacheteLinearKernel)" in md
    assert "- awq_marlin, awq_marlin:marlin, awq:triton: `run A`" in md and "- awq_turbomind: `run B`" in md
    assert "32 layers, hidden 4096, intermediate 14336, 32 q / 8 KV heads, head_dim 128, vocab 128256" in md
    assert (tmp_path / "awq.png").stat().st_size > 0


def test_all_rows_failed_still_writes(tmp_path):
    rows = [dict(method="awq_marlin", linear_backend="machete", label="awq_marlin:machete", kernel=None,
                 output_tok_s=None, decode_latency_ms=None, error="exit status 1: ValueError: x | y")]
    awq.BENCH.write(rows, tmp_path / "awq", awq.model_config(2), dict(prompts=10, input_len=64, output_len=8,
                                                                      gpu_memory_utilization=0.85, seed=0))
    md = (tmp_path / "awq.md").read_text()
    assert "**failed**: exit status 1: ValueError: x \\| y" in md and "best vLLM throughput" not in md
    assert (tmp_path / "awq.png").exists()


def test_main_merges_rows_and_writes_after_each(tmp_path, monkeypatch):
    """The parent without an engine: the checkpoint and each row's child stubbed."""
    out = tmp_path / "res"
    monkeypatch.setattr(awq, "ensure_checkpoint", lambda model, path: tmp_path)
    seen, merging = [], False

    def fake_measure(spec, cmd, log, timeout, command):
        seen.append((spec, cmd[-1], log.name, timeout))
        if not merging:
            assert out.with_suffix(".json").exists() == (len(seen) > 1)  # written after every row
        q, b = awq.parse_method(spec)
        return dict(method=q, linear_backend=b or "auto", label=spec, kernel="k", output_tok_s=float(len(seen)),
                    decode_latency_ms=1.0, command=command)

    monkeypatch.setattr(awq.BENCH, "measure", fake_measure)
    awq.main(["--methods", "awq_turbomind,awq_marlin", "--out", str(out), "--timeout", "60"])
    assert seen == [("awq_turbomind", "awq_turbomind", "awq_turbomind.log", 60.0),
                    ("awq_marlin", "awq_marlin", "awq_marlin.log", 60.0)]
    assert [r["label"] for r in json.loads(out.with_suffix(".json").read_text())["rows"]] == [
        "awq_marlin", "awq_turbomind"]  # the default methods' order
    seen.clear()
    merging = True
    awq.main(["--methods", "awq_marlin:machete,awq_marlin", "--out", str(out), "--merge"])
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["label"] for r in rows] == ["awq_marlin", "awq_marlin:machete", "awq_turbomind"]
    assert [s[2] for s in seen] == ["awq_marlin-machete.log", "awq_marlin.log"]
