"""benchmarks/e2e.py without a GPU: the model shapes and the written results."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import e2e  # noqa: E402


def test_model_shapes():
    assert e2e.model_config("16/4") == (e2e.MODEL, "e2e")
    model, stem = e2e.model_config("32/8")
    assert stem == "e2e_32q8kv"
    assert (model["num_attention_heads"], model["num_key_value_heads"], model["hidden_size"]) == (32, 8, 4096)
    assert model["head_dim"] == 128 and model["num_hidden_layers"] == e2e.MODEL["num_hidden_layers"]


def test_write_tables_ratios_and_plot(tmp_path):
    rows = [dict(kv="bf16", kv_tokens=1000, decode_tok_s_64x8k=100.0, prefill_tok_s_64x8k=50.0, command="run A"),
            dict(kv="tq4", kv_tokens=3760, decode_tok_s_64x8k=120.0, decode_only_tok_s_64x8k=130.0,
                 prefill_tok_s_64x8k=40.0, at_limit_req_s=2.5,
                 at_limit_generated=1024, command="run B")]
    model, stem = e2e.model_config("32/8")
    e2e.write(rows, tmp_path, "64x8192", model, stem)
    data = json.loads((tmp_path / "e2e_32q8kv.json").read_text())
    assert [r["kv_tokens_vs_bf16"] for r in data["rows"]] == [1.0, 3.76]
    assert data["rows"][1]["prefill_tok_s"] == 40.0 and data["rows"][0]["decode_tok_s_32x32k"] is None
    md = (tmp_path / "e2e_32q8kv.md").read_text()
    assert "32 q / 8 KV heads" in md and "| tq4 | 3,760 | 3.76x | 120 |  | 130 |  | 40 | 2.50 |" in md
    assert "- bf16: `run A`" in md and "- tq4: `run B`" in md  # merged rows name the call that measured them
    assert "Memory-limit load: 1024 tokens generated per request." in md
    assert (tmp_path / "e2e_32q8kv.png").stat().st_size > 0


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
    e2e.write(rows, tmp_path, "64x8192", e2e.MODEL, "e2e_tp2")
    assert json.loads((tmp_path / "e2e_tp2.json").read_text())["meta"]["tensor_parallel_size"] == 2
    assert "4 KV heads, head_dim 128, tensor parallel 2." in (tmp_path / "e2e_tp2.md").read_text()
