"""benchmarks.weights without a GPU: the arguments, each row's child command, engine arguments and environment, the
children's logs and the written results."""

import json
import os
import sys
from pathlib import Path

import pytest

from benchmarks import common, engine_rows, weights


def test_arguments_defaults():
    args = weights.BENCH.arguments([])
    assert args.method_list == ["bf16", "fp8", "quartet2"]
    assert (args.prompts, args.input_len, args.output_len, args.layers) == (1000, 1024, 128, 32)
    assert args.gpu_memory_utilization == 0.85 and not args.merge and args.out is None and args.timeout == 0
    assert args.child is None and args.model_dir is None


def test_methods_are_canonical_and_checked():
    assert weights.BENCH.methods(" BF16, quartet2:auto ,quartet2, quartet2:Emulate,fp8,quartet2:marlin ") == [
        "bf16", "quartet2", "quartet2:emulate", "fp8", "quartet2:marlin"]
    assert weights.parse_method("quartet2") == ("quartet2", None)
    assert weights.parse_method("quartet2:emulate") == ("quartet2", "emulate")
    assert weights.parse_method("quartet2:w4a4") == ("quartet2", "w4a4")  # Blackwell
    assert weights.parse_method("fp8") == ("fp8", None)
    for bad in ("fp8:marlin", "bf16:emulate", "quartet2:fp4", "", "fp 8"):
        with pytest.raises(ValueError):
            weights.parse_method(bad)
    for bad in (["--methods", "quartet2:fast"], ["--methods", ","], ["--output-len", "1"], ["--child", "bf16"]):
        with pytest.raises(SystemExit):
            weights.BENCH.arguments(bad)


def test_child_commands_per_method(tmp_path):
    args = weights.BENCH.arguments(["--methods", "bf16,fp8,quartet2,quartet2:emulate", "--prompts", "200",
                                    "--input-len", "512", "--output-len", "64", "--layers", "4",
                                    "--gpu-memory-utilization", "0.8", "--timeout", "300", "--merge",
                                    "--out", str(tmp_path / "r")])
    for spec in args.method_list:
        cmd = weights.BENCH.child_command(spec, tmp_path, args)
        assert cmd[:3] == [sys.executable, "-m", "benchmarks.weights"]
        assert cmd[-4:] == ["--model-dir", str(tmp_path), "--child", spec]
        child = weights.BENCH.arguments(cmd[3:])  # the child reads back what the parent measures
        assert (child.child, child.model_dir, child.prompts, child.input_len, child.output_len, child.layers,
                child.gpu_memory_utilization) == (spec, tmp_path, 200, 512, 64, 4, 0.8)
        assert not child.merge and child.out is None and child.timeout == 0  # parent-only options stay there


def test_engine_arguments_and_environment_per_method():
    specs = weights.BENCH.methods("bf16,fp8,quartet2,quartet2:emulate,quartet2:marlin")
    kw = {spec: weights.BENCH.llm_kwargs(*weights.parse_method(spec), "/m", 1024, 128, 0.85) for spec in specs}
    assert {s: k.get("quantization") for s, k in kw.items()} == {
        "bf16": None, "fp8": "fp8", "quartet2": "quartet2", "quartet2:emulate": "quartet2",
        "quartet2:marlin": "quartet2"}
    for k in kw.values():
        assert k["load_format"] == "dummy" and k["dtype"] == "bfloat16" and k["model"] == "/m"
        assert k["skip_tokenizer_init"] and not k["enable_prefix_caching"]
        assert k["max_model_len"] == 1024 + 128 + 8 and k["gpu_memory_utilization"] == 0.85
        assert "enforce_eager" not in k and "compilation_config" not in k  # vLLM's default compilation and graphs
    assert {s: weights.row_env(*weights.parse_method(s)) for s in specs} == {
        "bf16": {}, "fp8": {}, "quartet2": {"TURBOQUANT_QUARTET2_PATH": "auto"},
        "quartet2:emulate": {"TURBOQUANT_QUARTET2_PATH": "emulate"},
        "quartet2:marlin": {"TURBOQUANT_QUARTET2_PATH": "marlin"}}
    from turboquant_vllm.quant.quartet2.plugin import config, paths

    assert weights.PATH_ENV == paths.PATH_ENV and weights.PATHS == paths.PATHS and weights.OURS == config.NAME
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(**kw["fp8"])  # vLLM takes every keyword
    assert (args.load_format, args.quantization) == ("dummy", "fp8")


def test_result_paths(tmp_path):
    stem, logs = weights.BENCH.result_paths(weights.BENCH.arguments([]), gpu="h100")
    assert stem == common.RESULTS / "weights"
    assert logs == common.RESULTS / "weights" / "h100-llama3-8b-32l-1000x1024-128"
    stem, logs = weights.BENCH.result_paths(weights.BENCH.arguments(["--layers", "8", "--prompts", "100"]), gpu="h200")
    assert stem == logs == common.RESULTS / "weights" / "h200-llama3-8b-8l-100x1024-128"
    stem, logs = weights.BENCH.result_paths(weights.BENCH.arguments(["--out", str(tmp_path / "run.md")]))
    assert stem == logs == tmp_path / "run"


def test_model_is_llama3_8b_in_bf16(tmp_path):
    from transformers import AutoConfig

    model = weights.model_config()
    assert model["num_hidden_layers"] == 32 and weights.model_config(4)["num_hidden_layers"] == 4
    assert model["torch_dtype"] == "bfloat16" and "quantization_config" not in model
    assert weights.model_config(input_len=16384)["max_position_embeddings"] >= 16384 + 128
    folder = weights.write_model(model, tmp_path / "m")
    assert [p.name for p in folder.iterdir()] == ["config.json"]  # dummy weights: nothing else
    cfg = AutoConfig.from_pretrained(folder)
    assert type(cfg).__name__ == "LlamaConfig"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.vocab_size) == (4096, 14336, 32, 8, 128, 128256)


LOG = """INFO 11-26 02:00:00 [model.py:1] Resolved architecture: LlamaForCausalLM
(EngineCore pid=123) INFO 11-26 02:00:05 [model_runner.py:302] Model loading took 14.99 GiB and 9.1 seconds
(EngineCore pid=123) INFO 11-26 02:00:40 [gpu_worker.py:539] Available KV cache memory: 50.12 GiB
"""
QUARTET2 = ("INFO 11-26 03:38:39 [method.py:81] quartet2: NVFP4 path marlin (auto on sm90: no FP4 tensor cores; NVFP4 "
            "weights through vLLM's Marlin FP4 (W4A16)), weights quantized after loading\n")
FP8 = ("(EngineCore pid=9) INFO 11-26 02:00:05 [__init__.py:640] Selected CutlassFP8ScaledMMLinearKernel for "
       "Fp8PerTensorOnlineLinearMethod\n")


def test_log_facts():
    assert weights.BENCH.log_facts(LOG) == dict(kernel=None, weights_gib=14.99, kv_cache_gib=50.12, error=None)
    assert weights.BENCH.log_facts(QUARTET2 + LOG)["kernel"] == "Marlin FP4 W4A16 (quartet2 marlin)"
    assert weights.BENCH.log_facts(QUARTET2.replace("path marlin", "path emulate") * 2)["kernel"] == (
        "W4A4 emulation (quartet2 emulate)")
    assert weights.BENCH.log_facts(FP8 + LOG)["kernel"] == "CutlassFP8ScaledMMLinearKernel"
    mma = ("INFO 11-27 02:30:00 [method.py:127] quartet2: GEMMs of 1-4 tokens run the native few-token kernel "
           "(/root/.cache/turboquant-vllm/marlin_mma-0123456789ab.so; TURBOQUANT_QUARTET2_MMA=0 keeps Marlin)\n")
    assert weights.BENCH.log_facts(QUARTET2 + mma + LOG)["kernel"] == (
        "Marlin FP4 W4A16 (quartet2 marlin) + few-token mma kernel (1-4 tokens)")
    failed = weights.BENCH.log_facts(LOG + "ValueError: quartet2: vLLM's Marlin FP4 kernel does not run here\n")
    assert failed["error"] == "ValueError: quartet2: vLLM's Marlin FP4 kernel does not run here"


def fake_child(tmp_path, code: str) -> list[str]:
    script = tmp_path / "child.py"
    script.write_text(code)
    return [sys.executable, str(script)]


def test_measure_rows_their_environment_and_failures(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBOQUANT_QUARTET2_PATH", "emulate")  # the caller's: never leaks into the plain row
    code = ("import json, os, sys\nsys.stderr.write({log!r})\n"
            "print('WEIGHTS_ROW ' + json.dumps(dict({row}, env_path=os.environ.get('TURBOQUANT_QUARTET2_PATH'), "
            "cache=os.environ['VLLM_CACHE_ROOT'])))\n")
    row = dict(method="quartet2", path="auto", label="quartet2", output_tok_s=2000.0, decode_latency_ms=5.0)
    got = weights.BENCH.measure("quartet2", fake_child(tmp_path, code.format(log=QUARTET2 + LOG, row=row)),
                                tmp_path / "logs" / "quartet2.log", None, "cmd A")
    assert got["output_tok_s"] == 2000.0 and got["kernel"] == "Marlin FP4 W4A16 (quartet2 marlin)"
    assert got["env_path"] == "auto" and got["weights_gib"] == 14.99 and got["command"] == "cmd A"
    assert not os.path.exists(got["cache"])  # a fresh compile cache per row, gone after it
    assert "quartet2: NVFP4 path marlin" in (tmp_path / "logs" / "quartet2.log").read_text()

    row = dict(method="bf16", path=None, label="bf16", kernel=weights.BF16_KERNEL, output_tok_s=1000.0,
               decode_latency_ms=9.0)
    got = weights.BENCH.measure("bf16", fake_child(tmp_path, code.format(log=LOG, row=row)), tmp_path / "b.log", None,
                                "B")
    assert got["kernel"] == weights.BF16_KERNEL and got["env_path"] == "emulate"  # bf16's env as the caller's

    got = weights.BENCH.measure("quartet2:emulate", fake_child(tmp_path, "raise ValueError('no path')\n"),
                                tmp_path / "c.log", None, "C")
    assert (got["method"], got["path"], got["label"], got["output_tok_s"]) == ("quartet2", "emulate",
                                                                              "quartet2:emulate", None)
    assert got["error"] == "exit status 1: ValueError: no path"

    slow = fake_child(tmp_path, "import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    got = weights.BENCH.measure("fp8", slow, tmp_path / "d.log", 1, "D")
    assert got["error"] == "timed out after 1 s" and got["path"] is None
    assert "started" in (tmp_path / "d.log").read_text()


SETTINGS = dict(prompts=1000, input_len=1024, output_len=128, gpu_memory_utilization=0.85, seed=0)


def test_write_ratios_vs_bf16_failed_rows_and_plot(tmp_path):
    rows = [dict(method="bf16", path=None, label="bf16", kernel=weights.BF16_KERNEL, output_tok_s=2000.0,
                 decode_latency_ms=8.0, kv_cache_tokens=400000, weights_gib=14.96,
                 cudagraph_mode="FULL_AND_PIECEWISE", command="run A"),
            dict(method="fp8", path=None, label="fp8", kernel="CutlassFP8ScaledMMLinearKernel", output_tok_s=2500.0,
                 decode_latency_ms=5.0, kv_cache_tokens=450000, weights_gib=8.46, command="run A"),
            dict(method="quartet2", path="auto", label="quartet2", kernel="Marlin FP4 W4A16 (quartet2 marlin)",
                 output_tok_s=1600.0, decode_latency_ms=3.2, kv_cache_tokens=480000, weights_gib=5.61,
                 command="run B"),
            dict(method="quartet2", path="emulate", label="quartet2:emulate", kernel=None, output_tok_s=None,
                 decode_latency_ms=None, error="timed out after 300 s", command="run B")]
    meta = common.provenance("python -m benchmarks weights")
    weights.BENCH.write(rows, tmp_path / "w", weights.model_config(), SETTINGS, meta)
    data = json.loads((tmp_path / "w.json").read_text())
    assert data["meta"]["command"] == "python -m benchmarks weights" and data["meta"]["versions"]["torch"]
    assert data["meta"]["prompts"] == 1000 and data["meta"]["model"]["num_hidden_layers"] == 32
    assert data["meta"]["load_format"] == "dummy"
    got = {r["label"]: r for r in data["rows"]}
    assert got["quartet2"]["output_tok_s_vs_bf16"] == pytest.approx(0.8)
    assert got["quartet2"]["decode_speed_vs_bf16"] == pytest.approx(2.5)
    assert got["fp8"]["decode_speed_vs_bf16"] == pytest.approx(1.6)
    assert got["bf16"]["output_tok_s_vs_bf16"] == pytest.approx(1.0)
    assert got["quartet2:emulate"]["output_tok_s_vs_bf16"] is None and got["quartet2:emulate"]["error"]
    md = (tmp_path / "w.md").read_text()
    assert md.startswith("<sub>`python -m benchmarks weights` at commit ")
    assert ("| method | quartet2 path | kernel | output tok/s | vs bf16 | run s = prefill + decode | "
            "batch-1 decode ms/token | decode speed vs bf16 | CUDA graphs | KV cache tokens | weights GiB |") in md
    assert ("| bf16 |  | UnquantizedLinearMethod (bf16 matmul) | 2,000 | 1.00x |  | 8.00 | 1.00x | full_and_piecewise "
            "| 400,000 | 14.96 |") in md
    assert ("| quartet2 | auto | Marlin FP4 W4A16 (quartet2 marlin) | 1,600 | 0.80x |  | 3.20 | 2.50x |  | 480,000 | "
            "5.61 |") in md
    assert "| quartet2 | emulate | **failed**: timed out after 300 s |  |  |  |  |  |  |  |" in md
    assert "- bf16, fp8: `run A`" in md and "- quartet2, quartet2:emulate: `run B`" in md
    assert "32 layers, hidden 4096, intermediate 14336, 32 q / 8 KV heads, head_dim 128, vocab 128256" in md
    assert "no bf16 row measured" not in md
    assert (tmp_path / "w.png").stat().st_size > 0


def test_without_bf16_no_ratios(tmp_path):
    rows = [dict(method="bf16", path=None, label="bf16", kernel=weights.BF16_KERNEL, output_tok_s=None,
                 decode_latency_ms=None, error="exit status 1: RuntimeError: x | y"),
            dict(method="quartet2", path="auto", label="quartet2", kernel="k", output_tok_s=10.0,
                 decode_latency_ms=1.0)]
    weights.BENCH.write(rows, tmp_path / "w", weights.model_config(2), dict(SETTINGS, prompts=10))
    data = json.loads((tmp_path / "w.json").read_text())
    assert data["rows"][1]["output_tok_s_vs_bf16"] is None and data["rows"][1]["decode_speed_vs_bf16"] is None
    md = (tmp_path / "w.md").read_text()
    assert "**failed**: exit status 1: RuntimeError: x \\| y" in md and "no bf16 row measured" in md
    assert (tmp_path / "w.png").exists()


def test_main_merges_rows_and_writes_after_each(tmp_path, monkeypatch):
    """The parent without an engine: each row's child stubbed."""
    out = tmp_path / "res"
    seen, merging = [], False

    def fake_measure(spec, cmd, log, timeout, command):
        model_dir = cmd[cmd.index("--model-dir") + 1]
        config = json.loads((Path(model_dir) / "config.json").read_text())
        seen.append((spec, cmd[-1], log.name, timeout, config["num_hidden_layers"]))
        if not merging:
            assert out.with_suffix(".json").exists() == (len(seen) > 1)  # written after every row
        method, path = weights.parse_method(spec)
        return dict(method=method, path=path, label=spec, kernel="k", output_tok_s=float(len(seen)),
                    decode_latency_ms=1.0, command=command)

    monkeypatch.setattr(weights.BENCH, "measure", fake_measure)
    weights.main(["--methods", "quartet2,bf16", "--layers", "2", "--out", str(out), "--timeout", "60"])
    assert seen == [("quartet2", "quartet2", "quartet2.log", 60.0, 2), ("bf16", "bf16", "bf16.log", 60.0, 2)]
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["label"] for r in rows] == ["bf16", "quartet2"]  # bf16 first
    assert rows[1]["output_tok_s_vs_bf16"] == pytest.approx(0.5)
    seen.clear()
    merging = True
    weights.main(["--methods", "quartet2:emulate,fp8,quartet2", "--layers", "2", "--out", str(out), "--merge"])
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["label"] for r in rows] == ["bf16", "fp8", "quartet2", "quartet2:emulate"]
    assert [s[2] for s in seen] == ["quartet2-emulate.log", "fp8.log", "quartet2.log"]
    assert rows[2]["output_tok_s"] == 3.0  # quartet2 measured again, not the merged row


# ---- --model cloverlm-4b ----------------------------------------------------------------------------------------

def test_arguments_per_model():
    args = weights.BENCH.arguments(["--model", "cloverlm-4b"])
    assert args.model == "cloverlm-4b"
    assert args.method_list == ["bf16", "quartet2:marlin", "quartet2:emulate", "modelopt_fp4"]
    assert (args.prompts, args.input_len, args.output_len, args.layers) == (64, 1024, 128, 29)  # all 29 blocks
    args = weights.BENCH.arguments(["--model", "cloverlm-4b", "--layers", "4", "--prompts", "8", "--methods", "bf16"])
    assert (args.prompts, args.layers, args.method_list) == (8, 4, ["bf16"])
    assert weights.BENCH.arguments([]).model == "llama3-8b"
    assert weights.BENCH.arguments(["--layers", "4"]).prompts == 1000  # llama3-8b's defaults stay
    for bad in (["--model", "llama3-70b"], ["--model", "cloverlm-4b", "--output-len", "1"]):
        with pytest.raises(SystemExit):
            weights.BENCH.arguments(bad)


def test_cloverlm_child_command_reads_back(tmp_path):
    args = weights.BENCH.arguments(["--model", "cloverlm-4b", "--layers", "3", "--timeout", "130"])
    cmd = weights.BENCH.child_command("modelopt_fp4", tmp_path, args)
    assert cmd[-6:] == ["--model", "cloverlm-4b", "--model-dir", str(tmp_path), "--child", "modelopt_fp4"]
    child = weights.BENCH.arguments(cmd[3:])
    assert (child.model, child.child, child.layers, child.prompts, child.input_len, child.output_len,
            child.timeout) == ("cloverlm-4b", "modelopt_fp4", 3, 64, 1024, 128, 0)


def cloverlm_params(model: dict) -> int:
    d, d_ff, kv = model["hidden_size"], model["intermediate_size"], model["num_key_value_heads"] * model["head_dim"]
    block = d * (d + 2 * kv) + d * d + 2 * d * d_ff  # qkv, lo, l1, l2
    return model["num_blocks"] * block + model["vocab_size"] * d  # the head tied to the embedding


def test_cloverlm_4b_config(tmp_path):
    from transformers import AutoConfig

    from turboquant_vllm.models.cloverlm.config import MODEL_TYPE, CloverLMConfig
    from turboquant_vllm.models.cloverlm.reference import CloverLMShape

    model = weights.model_config(29, 1024, 128, "cloverlm-4b")
    assert model["architectures"] == ["CloverLMForCausalLM"] and model["model_type"] == "cloverlm"
    assert (model["num_blocks"], model["heads"], model["d_head"], model["ratio"], model["vocab_size"]) == (
        29, 28, 128, 4, 32000)
    assert model["weight_tying"] and model["tie_word_embeddings"] and model["torch_dtype"] == "bfloat16"
    assert 3.9e9 < cloverlm_params(model) < 4.1e9  # CloverLM-4B
    assert model["max_position_embeddings"] == model["max_context"] == 1024 + 128 + 8  # raised for the requests
    assert weights.model_config(29, 512, 128, "cloverlm-4b")["max_context"] == 1024  # never below what it trained at
    assert weights.model_config(5, 1024, 128, "cloverlm-4b")["num_hidden_layers"] == 5
    assert "quantization_config" not in model
    with pytest.raises(ValueError):
        weights.model_config(model="cloverlm-7b")
    shape = CloverLMShape.from_config(model)
    assert (shape.d, shape.kv_heads, shape.d_ff) == (3584, 7, 14336)
    assert "29 layers, hidden 3584, intermediate 14336, 28 q / 7 KV heads, head_dim 128, vocab 32000" in (
        engine_rows.shape_text(model))
    AutoConfig.register(MODEL_TYPE, CloverLMConfig, exist_ok=True)
    cfg = AutoConfig.from_pretrained(weights.write_model(model, tmp_path / "m"))
    assert type(cfg).__name__ == "CloverLMConfig"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.num_hidden_layers, cfg.tie_word_embeddings) == (3584, 14336, 28, 7, 128, 29, True)
    assert weights.model_title(model) == "CloverLM-4B" and weights.model_title(weights.model_config()) == "Llama-3-8B"


def test_row_model_folders(tmp_path):
    model = weights.model_config(2, 1024, 128, "cloverlm-4b")
    plain = weights.row_model_dir("quartet2:marlin", model, tmp_path)
    assert weights.row_model_dir("bf16", model, tmp_path) == plain
    assert [p.name for p in plain.iterdir()] == ["config.json"]
    nvfp4 = weights.row_model_dir("modelopt_fp4", model, tmp_path)
    assert nvfp4 != plain and sorted(p.name for p in nvfp4.iterdir()) == ["config.json", "hf_quant_config.json"]
    assert json.loads((nvfp4 / "config.json").read_text()) == model
    quant = json.loads((nvfp4 / "hf_quant_config.json").read_text())
    assert quant == {"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": ["emb", "linear"]}}
    assert weights.modelopt_quant_config(weights.model_config())["quantization"]["exclude_modules"] == ["lm_head"]
    assert weights.BENCH.llm_kwargs("modelopt_fp4", None, str(nvfp4), 1024, 128, 0.85)["quantization"] == (
        "modelopt_fp4")


def test_vllm_reads_the_row_folders(tmp_path):
    """vLLM 0.25's own config path (no engine): the modelopt_fp4 folder as ModelOpt NVFP4 with CloverLM's layers
    quantized and its embedding excluded; the bf16 rows' folder with no quantization that a method could claim."""
    from vllm.config import LoadConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.weight_utils import get_quant_config

    from turboquant_vllm.models.cloverlm import vllm_model

    vllm_model.register()
    model = weights.model_config(2, 1024, 128, "cloverlm-4b")
    kw = weights.BENCH.llm_kwargs("modelopt_fp4", None, str(weights.row_model_dir("modelopt_fp4", model, tmp_path)),
                                  1024, 128, 0.85)
    config = EngineArgs(**kw).create_model_config()
    assert config.quantization == "modelopt_fp4" and config.max_model_len == 1024 + 128 + 8
    quant = get_quant_config(config, LoadConfig(load_format="dummy"))
    assert type(quant).__name__ == "ModelOptNvFp4Config" and quant.group_size == 16
    quant.packed_modules_mapping = vllm_model.CloverLMForCausalLM.packed_modules_mapping
    assert quant.is_layer_excluded("transformer.emb") and quant.is_layer_excluded("transformer.linear")
    for layer in ("mhsa.qkv", "mhsa.lo", "mlp.l1", "mlp.l2"):
        assert not quant.is_layer_excluded(f"transformer.blocks.1.{layer}")
    kw = weights.BENCH.llm_kwargs("bf16", None, str(weights.row_model_dir("bf16", model, tmp_path)), 1024, 128, 0.85)
    assert EngineArgs(**kw).create_model_config().quantization is None


def test_child_refuses_an_unknown_architecture():
    weights.check_architecture("LlamaForCausalLM")
    with pytest.raises(RuntimeError, match="vLLM does not know the architecture NoSuchForCausalLM: .*entry point"):
        weights.check_architecture("NoSuchForCausalLM")


def test_cloverlm_result_paths(tmp_path):
    args = weights.BENCH.arguments(["--model", "cloverlm-4b"])
    stem, logs = weights.BENCH.result_paths(args, gpu="h100")
    assert stem == logs == common.RESULTS / "weights" / "h100-cloverlm-4b-29l-64x1024-128"  # never the headline
    assert weights.BENCH.summary_path(args, stem) == common.RESULTS / "quartet2.json"
    args = weights.BENCH.arguments(["--model", "cloverlm-4b", "--out", str(tmp_path / "run.json")])
    stem, logs = weights.BENCH.result_paths(args)
    assert stem == logs == tmp_path / "run"
    assert weights.BENCH.summary_path(args, stem) == tmp_path / "run-quartet2.json"
    llama = weights.BENCH.arguments([])
    assert weights.BENCH.summary_path(llama, common.RESULTS / "weights") is None  # llama3-8b: none
    # llama3-8b's names as before
    assert weights.BENCH.result_paths(weights.BENCH.arguments(["--layers", "8"]), gpu="h100")[0] == (
        common.RESULTS / "weights" / "h100-llama3-8b-8l-1000x1024-128")


MODELOPT_LOG = ("(EngineCore pid=9) INFO 11-26 02:00:05 [__init__.py:963] Using MarlinNvFp4LinearKernel for NVFP4 "
                "GEMM\n")


def test_log_facts_modelopt_kernel():
    assert weights.BENCH.log_facts(MODELOPT_LOG + LOG)["kernel"] == "MarlinNvFp4LinearKernel"


def cloverlm_rows() -> list[dict]:
    return [dict(method="bf16", path=None, label="bf16", kernel=weights.BF16_KERNEL, output_tok_s=4000.0,
                 decode_latency_ms=4.0, weights_gib=7.52, command="run A"),
            dict(method="quartet2", path="marlin", label="quartet2:marlin", kernel="Marlin FP4 W4A16 (quartet2 marlin)",
                 output_tok_s=4400.0, decode_latency_ms=1.6, weights_gib=2.31, command="run A"),
            dict(method="quartet2", path="emulate", label="quartet2:emulate", kernel=None, output_tok_s=None,
                 decode_latency_ms=None, error="timed out after 130 s", command="run A"),
            dict(method="modelopt_fp4", path=None, label="modelopt_fp4", kernel="MarlinNvFp4LinearKernel",
                 output_tok_s=4300.0, decode_latency_ms=1.7, weights_gib=2.30, command="run A"),
            dict(method="quartet2", path="auto", label="quartet2", kernel="Marlin FP4 W4A16 (quartet2 marlin)",
                 output_tok_s=4350.0, decode_latency_ms=1.65, weights_gib=2.31, command="run B")]


def test_summary_schema_from_rows(tmp_path):
    got = weights.summary(cloverlm_rows())
    assert got == {"rows": [
        {"path": "bf16", "decode_latency_ms": 4.0, "output_tok_s": 4000.0, "weight_gib": 7.52},
        {"path": "marlin", "decode_latency_ms": 1.6, "output_tok_s": 4400.0, "weight_gib": 2.31},
        {"path": "modelopt_fp4", "decode_latency_ms": 1.7, "output_tok_s": 4300.0, "weight_gib": 2.30},
        {"path": "quartet2", "decode_latency_ms": 1.65, "output_tok_s": 4350.0, "weight_gib": 2.31}]}
    weights.BENCH.write_summary(tmp_path / "s" / "quartet2.json", cloverlm_rows())
    assert json.loads((tmp_path / "s" / "quartet2.json").read_text()) == got
    assert weights.summary([]) == {"rows": []}


def test_write_cloverlm_results(tmp_path):
    model = weights.model_config(29, 1024, 128, "cloverlm-4b")
    weights.BENCH.write(cloverlm_rows()[:4], tmp_path / "c", model,
                        dict(SETTINGS, prompts=64, model_name="cloverlm-4b"))
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["meta"]["model"]["architectures"] == ["CloverLMForCausalLM"] and data["meta"]["prompts"] == 64
    got = {r["label"]: r for r in data["rows"]}
    assert got["quartet2:marlin"]["decode_speed_vs_bf16"] == pytest.approx(2.5)
    assert got["modelopt_fp4"]["output_tok_s_vs_bf16"] == pytest.approx(1.075)
    md = (tmp_path / "c.md").read_text()
    assert "vs bf16 weights, CloverLM-4B shape: 29 layers, hidden 3584" in md
    assert "modelopt_fp4: random NVFP4 parameters loaded as they are" in md
    assert "| modelopt_fp4 |  | MarlinNvFp4LinearKernel | 4,300 | 1.07x |  | 1.70 | 2.35x |" in md
    assert (tmp_path / "c.png").stat().st_size > 0


def test_main_cloverlm_writes_the_summary_after_each_row(tmp_path, monkeypatch):
    out = tmp_path / "res"
    summary = tmp_path / "res-quartet2.json"
    seen = []

    def fake_measure(spec, cmd, log, timeout, command):
        model_dir = Path(cmd[cmd.index("--model-dir") + 1])
        config = json.loads((model_dir / "config.json").read_text())
        seen.append((spec, config["architectures"][0], config["num_blocks"], (model_dir / "hf_quant_config.json")
                     .exists(), cmd[cmd.index("--model") + 1], timeout))
        assert summary.exists() == (len(seen) > 1)  # written after every row
        method, path = weights.parse_method(spec)
        return dict(method=method, path=path, label=spec, kernel="k", output_tok_s=100.0 * len(seen),
                    decode_latency_ms=4.0 / len(seen), weights_gib=7.5 / len(seen), command=command)

    monkeypatch.setattr(weights.BENCH, "measure", fake_measure)
    weights.main(["--model", "cloverlm-4b", "--layers", "2", "--out", str(out), "--timeout", "130"])
    assert seen == [("bf16", "CloverLMForCausalLM", 2, False, "cloverlm-4b", 130.0),
                    ("quartet2:marlin", "CloverLMForCausalLM", 2, False, "cloverlm-4b", 130.0),
                    ("quartet2:emulate", "CloverLMForCausalLM", 2, False, "cloverlm-4b", 130.0),
                    ("modelopt_fp4", "CloverLMForCausalLM", 2, True, "cloverlm-4b", 130.0)]
    data = json.loads(summary.read_text())
    assert [r["path"] for r in data["rows"]] == ["bf16", "marlin", "emulate", "modelopt_fp4"]
    assert all(set(r) == {"path", "decode_latency_ms", "output_tok_s", "weight_gib"} for r in data["rows"])
    assert data["rows"][1] == {"path": "marlin", "decode_latency_ms": 2.0, "output_tok_s": 200.0, "weight_gib": 3.75}
    results = json.loads(out.with_suffix(".json").read_text())
    assert results["meta"]["model"]["num_blocks"] == 2 and results["meta"]["model_name"] == "cloverlm-4b"
    assert [r["label"] for r in results["rows"]] == ["bf16", "quartet2:marlin", "quartet2:emulate", "modelopt_fp4"]
