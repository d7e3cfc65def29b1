"""benchmarks.e2e without a GPU: the model shapes, the result paths and the written results."""

import json

from benchmarks import common, e2e


def test_model_shapes():
    assert e2e.model_config("16/4") == e2e.MODEL
    model = e2e.model_config("32/8")
    assert (model["num_attention_heads"], model["num_key_value_heads"], model["hidden_size"]) == (32, 8, 4096)
    assert model["head_dim"] == 128 and model["num_hidden_layers"] == e2e.MODEL["num_hidden_layers"]


def test_result_paths_headline_and_configurations():
    results = common.RESULTS
    assert e2e.result_paths(e2e.MODEL, gpu="h200") == (results / "e2e", results / "e2e" / "h200-llama16l-16q4kv")
    stem, logs = e2e.result_paths(e2e.model_config("32/8"), gpu="h200")
    assert stem == logs == results / "e2e" / "h200-llama16l-32q8kv"
    assert e2e.result_paths(e2e.MODEL, tp=2, gpu="h200")[0].name == "h200-llama16l-16q4kv-tp2"
    assert (e2e.result_paths(e2e.MODEL, at_limit=8192, at_limit_generate=1024, gpu="h100")[0].name
            == "h100-llama16l-16q4kv-at-limit-8k-gen1024")
    assert e2e.result_paths(e2e.MODEL, runs="8x1024", gpu="h200")[0].name == "h200-llama16l-16q4kv-8x1k"


def test_write_tables_ratios_and_plot(tmp_path):
    rows = [dict(kv="bf16", kv_tokens=1000, decode_tok_s_64x8k=100.0, prefill_tok_s_64x8k=50.0, command="run A"),
            dict(kv="tq4", kv_tokens=3760, decode_tok_s_64x8k=120.0, decode_only_tok_s_64x8k=130.0,
                 prefill_tok_s_64x8k=40.0, at_limit_req_s=2.5,
                 at_limit_generated=1024, command="run B")]
    meta = common.provenance("python -m benchmarks e2e --heads 32/8")
    e2e.write(rows, tmp_path / "h200-llama16l-32q8kv", "64x8192", e2e.model_config("32/8"), meta)
    data = json.loads((tmp_path / "h200-llama16l-32q8kv.json").read_text())
    assert [r["kv_tokens_vs_bf16"] for r in data["rows"]] == [1.0, 3.76]
    assert data["rows"][1]["prefill_tok_s"] == 40.0 and data["rows"][0]["decode_tok_s_32x32k"] is None
    assert data["meta"]["runs"] == "64x8192" and data["meta"]["command"] == "python -m benchmarks e2e --heads 32/8"
    assert data["meta"]["versions"]["torch"] and data["meta"]["versions"]["triton"] and "commit" in data["meta"]
    assert "gpu" in data["meta"]
    md = (tmp_path / "h200-llama16l-32q8kv.md").read_text()
    assert md.startswith("<sub>`python -m benchmarks e2e --heads 32/8` at commit ")
    assert "32 q / 8 KV heads" in md and "| tq4 | 3,760 | 3.76x | 120 | 130 | 40 | 2.50 |" in md  # the runs measured
    assert "| decode tok/s 64x8k | decode-only steps 64x8k | prefill tok/s 64x8k |" in md and "32x32k" not in md
    assert "- bf16: `run A`" in md and "- tq4: `run B`" in md  # merged rows name the call that measured them
    assert "- `nvfp4`: FLASHINFER only" in md  # vLLM's caches that do not run on Hopper: a line each
    assert "Memory-limit load: 1024 tokens generated per request." in md
    assert (tmp_path / "h200-llama16l-32q8kv.png").stat().st_size > 0


def test_steps_split_the_prefill_phase_from_the_decode_only_steps():
    steps = e2e.Steps()
    assert steps.decode_only_tok_s is None
    steps.add(True, 0.5, 3)  # prefill chunks with three decodes riding along
    steps.add(False, 0.25, 64)
    steps.add(False, 0.25, 32)  # the early requests are done
    steps.seconds = 1.1
    assert steps.decode_only_tok_s == 96 / 0.5
    assert steps.summary() == dict(seconds=1.1, prefill_phase_s=0.5, prefill_phase_steps=1, prefill_phase_tokens=3,
                                   decode_only_s=0.5, decode_only_steps=2, decode_only_tokens=96,
                                   slowest_step_s=0.5, slowest_step=0)
    steps.add(False, 0.75, 1)  # a stall late in the run
    assert (steps.summary()["slowest_step_s"], steps.summary()["slowest_step"]) == (0.75, 3)


def test_tensor_parallel_rows_name_it(tmp_path):
    rows = [dict(kv="bf16", kv_tokens=2000, tensor_parallel_size=2, decode_tok_s_64x8k=100.0, command="run")]
    e2e.write(rows, tmp_path / "e2e", "64x8192", e2e.MODEL)
    assert json.loads((tmp_path / "e2e.json").read_text())["meta"]["tensor_parallel_size"] == 2
    assert "4 KV heads, head_dim 128, tensor parallel 2." in (tmp_path / "e2e.md").read_text()


def test_real_model_shapes_load_as_their_architectures(tmp_path):
    """Each --shape is a config transformers reads as that architecture, with the head size and query-head group the
    sweep's rows name (a group of 7, head_dim 64 / 96 / 256)."""
    from transformers import AutoConfig

    want = {"qwen2.5-7b": (128, 7), "smollm2-135m": (64, 3), "phi3-mini": (96, 1), "gemma2-9b": (256, 2)}
    assert set(e2e.SHAPES) == set(want)
    for name, (model, engine_args) in e2e.SHAPES.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(model))
        cfg = AutoConfig.from_pretrained(tmp_path / name)
        assert type(cfg).__name__.lower().startswith(model["model_type"].replace("_", "")), name
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        assert (head_dim, cfg.num_attention_heads // cfg.num_key_value_heads) == want[name]
        assert cfg.max_position_embeddings >= 32768 + e2e.GENERATED
        assert e2e.result_paths(model, gpu="h100", shape=name)[0].name == f"h100-{name}"
    assert e2e.SHAPES["gemma2-9b"][1] == {"disable_hybrid_kv_cache_manager": True}


def test_shape_rows_name_the_architecture(tmp_path):
    model = e2e.SHAPES["phi3-mini"][0]
    rows = [dict(kv="bf16", kv_tokens=10, decode_tok_s_64x8k=1.0, command="c"),
            dict(kv="tq4", kv_tokens=37, decode_tok_s_64x8k=1.5, command="c")]
    e2e.write(rows, tmp_path / "h100-phi3-mini", "64x8192", model, common.provenance("c"), "phi3-mini")
    md = (tmp_path / "h100-phi3-mini.md").read_text()
    assert ("phi3-mini shape (Phi3ForCausalLM) with random weights: 8 layers, hidden 3072, 32 q / 32 KV heads, "
            "head_dim 96") in md
    assert json.loads((tmp_path / "h100-phi3-mini.json").read_text())["meta"]["shape"] == "phi3-mini"


def test_vllm_takes_every_shape(tmp_path):
    """vLLM's own model config (architecture, head size, KV heads, the runs' context) accepts each --shape, so a
    device run does not find out."""
    from vllm.config import ModelConfig

    for name, (model, _) in e2e.SHAPES.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(model))
        cfg = ModelConfig(model=str(tmp_path / name), skip_tokenizer_init=True, dtype="bfloat16",
                          max_model_len=32768 + e2e.GENERATED + 8, seed=0)
        assert cfg.architectures == model["architectures"]
        head_dim = model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
        assert (cfg.get_head_size(), cfg.get_total_num_kv_heads()) == (head_dim, model["num_key_value_heads"])


def test_long_runs_extend_the_positions():
    """1 x 100k on the Llama shape: the config's positions grow to the longest run; shorter runs keep the model as it
    is (its headline result path too)."""
    assert e2e.fit_positions(e2e.MODEL, 8192) is e2e.MODEL
    longer = e2e.fit_positions(e2e.MODEL, 102400 + e2e.GENERATED + 8)
    assert longer["max_position_embeddings"] == 102536 and longer["num_hidden_layers"] == 16
    assert e2e.result_paths(longer, runs="1x102400", gpu="h100")[0].name == "h100-llama16l-16q4kv-1x100k"


def test_every_custom_cache_is_its_preset():
    from turboquant_vllm.core.presets import get_preset

    custom = {kv: env for kv, (backend, _, env) in e2e.KV.items() if backend == "CUSTOM"}
    assert {"tq4", "tq3", "k4v3"} <= set(custom)
    for kv, env in custom.items():
        assert get_preset(env["TURBOQUANT_PRESET"]).name == kv


def test_vllm_cache_rows():
    """vLLM's compressed caches that run on Hopper are rows by their kv_cache_dtype (the per-token-head ones on
    TRITON_ATTN, the turboquant_* on vLLM's pick); those that do not are a line of the report, never a row."""
    from benchmarks import common

    assert e2e.KV["int4_per_token_head"] == ("TRITON_ATTN", "int4_per_token_head", {})
    assert e2e.KV["turboquant_k8v4"] == (None, "turboquant_k8v4", {})
    assert {kv for kv, (_, dtype, _) in e2e.KV.items() if dtype not in ("auto", "fp8")} == set(common.VLLM_KV)
    assert not {name for name, _ in common.VLLM_KV_NOT_ON_HOPPER} & set(e2e.KV)


def test_vllm_cache_bytes_from_vllm():
    """vLLM's own page arithmetic, per token per KV head at head_dim 64 / 128 / 256: the per-token-head caches hold
    K and V plus an fp32 scale each (int4: two codes a byte), turboquant_* their packed K|V slot."""
    from benchmarks import common

    got = {kv: [common.vllm_bytes_per_token_per_head(kv, d) for d in (64, 128, 256)] for kv in common.VLLM_KV}
    assert got == {"int4_per_token_head": [72, 136, 264], "int8_per_token_head": [136, 264, 520],
                   "fp8_per_token_head": [136, 264, 520], "turboquant_k8v4": [100, 196, 388],
                   "turboquant_4bit_nc": [70, 134, 262], "turboquant_k3v4_nc": [62, 118, 230],
                   "turboquant_3bit_nc": [54, 102, 198]}
