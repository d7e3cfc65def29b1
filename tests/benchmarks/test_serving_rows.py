"""vLLM's compressed KV caches as rows of the serving benchmarks (serving_soak, serving_spec_decode): how each one's
server or engine is asked for its cache, and the report's line per cache that does not run on Hopper."""

from __future__ import annotations

from benchmarks import common
from benchmarks import serving_common as sc
from benchmarks import serving_soak as soak
from benchmarks import serving_spec_decode as spec


def test_soak_serves_vllm_caches_by_their_dtype():
    args = soak.parse_args(["--model", "/m", "--kv", "int4_per_token_head,turboquant_4bit_nc,tq4"])
    assert args.kv_list == ["int4_per_token_head", "turboquant_4bit_nc", "tq4"]
    assert soak.kv_serve_args("int4_per_token_head") == ("--kv-cache-dtype", "int4_per_token_head")
    assert soak.kv_serve_args("tq4") == () and soak.kv_serve_args("bf16") == ()
    cmd = sc.serve_command("/m", 8000, soak.KV["int4_per_token_head"][0], soak.kv_serve_args("int4_per_token_head"))
    assert cmd[cmd.index("--attention-backend") + 1] == "TRITON_ATTN"
    cmd = sc.serve_command("/m", 8000, soak.KV["turboquant_4bit_nc"][0], soak.kv_serve_args("turboquant_4bit_nc"))
    assert "--attention-backend" not in cmd and cmd[-1] == "turboquant_4bit_nc"  # vLLM's pick
    assert set(common.VLLM_KV) <= set(soak.KV) and not {n for n, _ in common.VLLM_KV_NOT_ON_HOPPER} & set(soak.KV)


def test_soak_report_names_the_caches_left_out():
    md = soak.markdown([dict(kv="int8_per_token_head", requests=10, failed=0, passed=True)],
                       dict(command="python -m benchmarks serving_soak", png="soak.png"))
    assert "| int8_per_token_head |" in md
    assert all(f"- `{name}`: {why}" in md for name, why in common.VLLM_KV_NOT_ON_HOPPER)


def test_spec_decode_engines_of_vllm_caches():
    args = spec.parse_args(["--model", "/m", "--kv", "fp8_per_token_head", "--no-control"])
    case = spec.case_spec("fp8_per_token_head", None, args, common.ROOT / "prompts.json")
    kw = spec.engine_kwargs(case)
    assert kw["kv_cache_dtype"] == "fp8_per_token_head" and kw["attention_config"] == {"backend": "TRITON_ATTN"}
    kw = spec.engine_kwargs(spec.case_spec("turboquant_k8v4", None, args, common.ROOT / "prompts.json"))
    assert kw["kv_cache_dtype"] == "turboquant_k8v4" and kw["attention_config"] == {"backend": None}
    assert "- `ultraquant_4bit`: ROCm only" in spec.markdown([], dict(
        repetitive=1, plain=1, data="d", max_tokens=8, single=1, graphs="g", near_tie=0.1, judge_margin=1.0))
