"""`turboquant-vllm demo` end to end on a tiny random model directory: the CPU path for real, the vLLM path with its
engines faked (they need a GPU; the engines' arithmetic and report are covered in tests/test_cli.py)."""

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from turboquant_vllm.cli import demo, main
from turboquant_vllm.hf import demo as hf_demo
from turboquant_vllm.vllm import requirements

WORDS = ["[UNK]", "<|im_start|>", "<|im_end|>", "user", "assistant", "the", "sea", "is", "blue", "sky", "hello",
         "world", ",", ".", "a", "of", "and", "in", "to", "was"]
EOS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """2 layers, 3 KV heads of dim 64 (SmolLM2's), a word-level tokenizer with a chat template."""
    path = tmp_path_factory.mktemp("tiny-model")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=192, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=3, head_dim=64, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=EOS, pad_token_id=0, initializer_range=0.01)
    LlamaForCausalLM(config).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>")
    fast.chat_template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    fast.save_pretrained(path)
    return path


def test_the_tokenizer_helpers(model_dir):
    tokenizer = hf_demo.load_tokenizer(model_dir)
    assert hf_demo.chat_ids(tokenizer, "the sea") == [1, 3, 5, 6, 2, 1, 4]
    assert hf_demo.stop_ids(model_dir, tokenizer) == [EOS]
    assert hf_demo.load_shape(model_dir) == {"layers": 2, "kv_heads": 3, "head_dim": 64}
    assert len(hf_demo.text_ids(tokenizer, hf_demo.wikitext_excerpt(), 1024)) == 1024
    assert hf_demo.wikitext_excerpt().lstrip().startswith("= Robert Boulter =")


def test_demo_on_the_cpu(model_dir, capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    code = main(["demo", "--model", str(model_dir), "--device", "cpu", "--tokens", "5", "--prompt", "hello world",
                 "--prompt", "the sky is"])
    lines = capsys.readouterr().out.strip().splitlines()
    # a random model: its perplexity cost may be above tq4's documented one (exit 0); only a broken cache fails
    assert lines[-1].startswith(("demo: ok (", "demo: above expectations: tq4 costs", "demo: FAILED (")), lines[-1]
    assert code == (1 if lines[-1].startswith("demo: FAILED") else 0), lines[-1]
    assert lines[1].startswith("engine: transformers ") and "on the CPU (1 thread), float32" in lines[1]
    assert torch.get_num_threads() == threads  # put back for whoever runs next in this process
    assert "prompt 1: hello world" in lines and "prompt 2: the sky is" in lines
    # 2 layers x 3 KV heads x 72 B (tq4 at head_dim 64), as stored
    assert "KV cache per token (2 layers x 3 KV heads): 432 B tq4 vs 1,536 B at 16 bits -> 3.56x" in lines
    assert "  measured: 221,184 B stored for 512 tokens (codes + fp32 norms; 432 B a token)" in lines
    assert any(line.startswith("perplexity, WikiText-2 excerpt (1022 tokens scored in windows of 512)")
               for line in lines)
    assert "no NaN" in lines[-1]


def fake_engines(calls: list, fail: str | None = None, ppl_ratio: float = 1.0, finite: bool = True):
    """subprocess.run for the engines: each echoes its prompts' last two tokens; ours changes prompt 2's second, has
    ppl_ratio times the baseline's perplexity, and finite logits or not."""
    def run(cmd, env, **kwargs):
        a = json.loads(cmd[-1])
        calls.append((a, env))
        if a["backend"] == fail:
            return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nRuntimeError: CUDA out of memory\n")
        answers = [p[-2:] + [EOS] for p in a["prompts"]]
        if a["backend"] == "CUSTOM":
            answers[1][1] = 5
        scored = sum(len(w) - 1 for w in a["windows"])
        ours = a["backend"] == "CUSTOM"
        result = {"label": a["label"], "continuations": answers,
                  "nll": scored * (1.0 + (math.log(ppl_ratio) if ours else 0.0)), "scored": scored,
                  "finite": finite or not ours, "seconds": 2.0,
                  "kv_tokens": 356_000 if a["backend"] == "CUSTOM" else 100_000, "device": "NVIDIA H100"}
        return subprocess.CompletedProcess(cmd, 0, "INFO vllm ...\n" + demo.RESULT_TAG + json.dumps(result) + "\n", "")
    return run


@pytest.fixture
def a_gpu_with_vllm(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(requirements, "installed_vllm_version", lambda: "0.33.0")


def test_demo_with_vllm_runs_one_engine_each(model_dir, a_gpu_with_vllm, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(demo.subprocess, "run", fake_engines(calls))
    monkeypatch.delenv("TURBOQUANT_PRESET", raising=False)
    assert main(["demo", "--model", str(model_dir), "--preset", "tq3", "--tokens", "7", "--prompt", "hello",
                 "--prompt", "the sea"]) == 0
    out = capsys.readouterr().out
    (flash, _), (ours, ours_env) = calls
    assert (flash["backend"], ours["backend"]) == ("FLASH_ATTN", "CUSTOM") and ours_env["TURBOQUANT_PRESET"] == "tq3"
    assert flash["prompts"] == ours["prompts"] == [[1, 3, 10, 2, 1, 4], [1, 3, 5, 6, 2, 1, 4]]
    assert flash["tokens"] == 7 and flash["eos"] == [EOS] and [len(w) for w in flash["windows"]] == [512, 512]
    assert "engine: vLLM 0.33.0 on NVIDIA H100, bfloat16" in out
    assert "vLLM's KV cache holds 356,000 tokens vs 100,000 (3.56x)" in out
    assert "first divergence at token 2; 1 of 2 tokens identical" in out  # the EOS is cut off both answers
    assert "token agreement (2 prompts, 4 tokens): 0.75 until the first divergence, 0.75 overall" in out
    assert out.strip().splitlines()[-1].startswith("demo: ok (no NaN; token agreement 0.75")


def test_a_failed_engine_fails_the_demo(model_dir, a_gpu_with_vllm, monkeypatch, capsys):
    monkeypatch.setattr(demo.subprocess, "run", fake_engines([], fail="CUSTOM"))
    assert main(["demo", "--model", str(model_dir), "--preset", "tq4"]) == 1
    captured = capsys.readouterr()
    assert "CUDA out of memory" in captured.err
    assert captured.out.strip().splitlines()[-1] == (
        "demo: FAILED (the vLLM TurboQuant tq4 engine exited with status 1 (its last lines above))")


def test_a_costly_preset_is_above_expectations_yet_a_broken_one_fails(model_dir, a_gpu_with_vllm, monkeypatch,
                                                                       capsys):
    expected = demo.EXPECTED_PPL_INCREASE["tq3"]
    monkeypatch.setattr(demo.subprocess, "run", fake_engines([], ppl_ratio=1 + expected + 0.1))
    assert main(["demo", "--model", str(model_dir), "--preset", "tq3"]) == 0  # it ran correctly: exit 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"demo: above expectations: tq3 costs {expected + 0.1:+.1%} perplexity, above the "
                           f"{expected:+.0%} documented for it on SmolLM2-135M"), last
    monkeypatch.setattr(demo.subprocess, "run", fake_engines([], finite=False))
    assert main(["demo", "--model", str(model_dir), "--preset", "tq3"]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("demo: FAILED (NaN or inf in the logits;")


def test_the_expected_costs_are_the_documented_ones():
    """EXPECTED_PPL_INCREASE is docs/quality.md's table in "The demo", column "expected at most"."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "quality.md").read_text()
    section = doc[doc.index("### The demo"):]
    section = section[:section.index("\n### ", 1)]
    rows = re.findall(r"^\| `(\w+)` \|.*\| \+(\d+)% \|$", section, re.MULTILINE)
    assert {p: int(x) / 100 for p, x in rows} == demo.EXPECTED_PPL_INCREASE
