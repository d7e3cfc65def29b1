"""benchmarks.quality on the CPU: its pure pieces, the scheduling of its children and the report, no vLLM engine."""

from __future__ import annotations

import json
import math
import re
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import reference_lm.passkey  # noqa: F401  the needle's texts: a broken import of ours fails, never skips
import turboquant_vllm.vllm.calibrate  # noqa: F401  what fit_calibration runs
from benchmarks import common, quality

# the converted SmolLM2-135M-Instruct, where `turboquant-vllm model smollm2` (turboquant_vllm.hf) may have made it
SMOLLM2 = next((p for p in map(Path, ("/tmp/smollm2-135m", "~/.cache/turboquant-vllm/smollm2-135m-instruct"))
                if (p.expanduser() / "tokenizer_config.json").exists()), Path("/tmp/smollm2-135m")).expanduser()


@pytest.mark.parametrize("prefix", [[], [0]], ids=["no-bos", "bos"])
def test_windows_score_every_token_once(prefix):
    ids = list(range(10, 1010))  # distinct ids: a token scored twice would show as a duplicate
    context, start = 64, max(1, len(prefix))
    wins = quality.windows(ids, context, prefix)
    assert len(wins) == len(ids) // (context - len(prefix))
    assert all(len(w) == context and w[: len(prefix)] == prefix for w in wins)
    scored = [t for w in wins for t in w[start:]]
    assert len(scored) == len(set(scored)) == len(wins) * (context - 1)
    assert not {w[0] for w in wins} & set(scored)  # the first token of a window has no prediction
    if prefix:  # behind a BOS every text token of the full windows is scored, in order
        assert scored == ids[: len(scored)]
    else:  # without one, exactly the windows' first tokens go unscored
        assert sorted(scored + [w[0] for w in wins]) == ids[: len(wins) * context]


def test_perplexity():
    ppl, n = quality.perplexity([[math.log(0.25)] * 3, [math.log(0.25)]])
    assert (ppl, n) == (pytest.approx(4.0), 4)
    assert quality.perplexity([[-1.0, -2.0], [-3.0]])[0] == pytest.approx(math.e**2)


def test_ppl_delta_is_paired_over_windows():
    base = {"ppl_wikitext2": math.exp(2.0), "wikitext2_window_nll": [1.0, 2.0, 3.0]}
    row = {"ppl_wikitext2": math.exp(2.02), "wikitext2_window_nll": [1.01, 2.02, 3.03]}
    delta, stderr = quality.ppl_delta(row, base)
    assert delta == pytest.approx((math.exp(0.02) - 1) * 100)
    diff = np.array([0.01, 0.02, 0.03])  # the spread of the windows' own NLL (1 to 3) does not count
    assert stderr == pytest.approx(100 * math.exp(0.02) * diff.std(ddof=1) / math.sqrt(3))
    assert quality.ppl_delta({"ppl_wikitext2": 2.2}, {"ppl_wikitext2": 2.0}) == (pytest.approx(10.0), None)
    assert quality.ppl_delta({}, base) is None and quality.ppl_delta(row, {}) is None


def test_kl_estimator_matches_exact_kl():
    rng = np.random.default_rng(0)
    k = 64
    p = rng.dirichlet(np.ones(k))
    q = 0.7 * p + 0.3 * rng.dirichlet(np.ones(k))
    log_ratio = np.log(p / q)
    exact = float(p @ log_ratio)
    x = rng.choice(k, size=(32, 512), p=p)  # 32 sequences of 512 tokens drawn from P, as bf16 samples
    mean, stderr, n = quality.kl_estimate(np.log(p)[x].tolist(), np.log(q)[x].tolist())
    assert n == x.size
    assert abs(mean - exact) < 4 * stderr
    sd = math.sqrt(float(p @ (log_ratio - exact) ** 2))  # iid tokens: the standard error is sd / sqrt(n)
    assert stderr == pytest.approx(sd / math.sqrt(n), rel=0.3)
    assert quality.kl_estimate(np.log(p)[x].tolist(), np.log(p)[x].tolist())[:2] == (0.0, 0.0)


def test_answer_matches_only_the_exact_key():
    assert quality.answer_matches(" 48213", 48213)
    assert quality.answer_matches(" 48213. Remember it", 48213)
    assert quality.answer_matches("48213<|im_end|>", 48213)
    assert quality.answer_matches("\n 48213", 48213)
    assert not quality.answer_matches(" 482135", 48213)  # a longer number
    assert not quality.answer_matches(" 48214", 48213)
    assert not quality.answer_matches(" the key 48213", 48213)
    assert not quality.answer_matches(" 4821", 48213)


def test_needle_grid_rows_are_depths():
    cells = [{"length": n, "depth": d} for n in (1024, 2048) for d in (0, 50, 100) for _ in range(4)]
    hits = [c["depth"] == 0 or (c["length"] == 1024 and i % 2 == 0) for i, c in enumerate(cells)]
    grid = quality.needle_grid(cells, hits)
    assert grid == {"lengths": [1024, 2048], "depths": [0, 50, 100], "per_cell": 4,
                    "accuracy": [[1.0, 1.0], [0.5, 0.0], [0.5, 0.0]]}


def test_default_lengths():
    assert quality.needle_lengths(8192) == [1024, 2048, 4096, 8000]
    assert quality.needle_lengths(4096) == [1024, 2048, 4000]
    assert quality.kl_prompt_range(None, 8192) == (2048, 4096)
    assert quality.kl_prompt_range(None, 4096) == (1024, 2048)  # the reference LM's run
    assert quality.kl_prompt_range("20,30", 4096) == (20, 30)


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer(folder: Path, bos: bool = True, chat: bool = False):
    """A byte-level BPE tokenizer trained here (digits single tokens), saved as an HF tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    words = [f"w{i % 97}x{i % 13}" for i in range(5000)] + ["The pass key is. Remember it. What?"] * 50
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # every byte: "\n" too
    tok.train_from_iterator([" ".join(words)], trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "additional_special_tokens": specials[2:]}
    if chat:
        config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return AutoTokenizer.from_pretrained(folder), words


def check_needle_prompts(tok, fmt: str, prefix: list[int], hay: list[int], lengths: list[int]) -> list[dict]:
    """What every needle prompt must be, for any tokenizer: exactly its length, its needle at its depth between the
    fixed head and tail, fresh keys per cell, the same prompts for the same seed."""
    from reference_lm import passkey

    depths = [0, 25, 50, 75, 100]
    cells = quality.needle_prompts(tok, fmt, prefix, hay, lengths, depths, n=4)
    assert [(c["length"], c["depth"]) for c in cells[::4]] == [(n, d) for n in lengths for d in depths]
    head, tail = quality.needle_pieces(tok, fmt, prefix)
    for c in cells:
        ids, needle = c["ids"], quality.encode(tok, passkey.needle(c["key"]))
        assert len(ids) == c["length"] and ids[:len(head)] == head and ids[len(ids) - len(tail):] == tail
        assert ids[c["at"]: c["at"] + len(needle)] == needle
        fill = c["length"] - len(head) - len(needle) - len(tail)
        assert abs(c["at"] - len(head) - c["depth"] / 100 * fill) <= 0.5  # at its depth into the haystack
        assert 10000 <= c["key"] < 100000
    assert all(len({c["key"] for c in cells[i:i + 4]}) == 4 for i in range(0, len(cells), 4))
    assert quality.needle_prompts(tok, fmt, prefix, hay, lengths, depths, n=4) == cells  # seeded
    return cells


@pytest.mark.parametrize("fmt", quality.NEEDLE_FORMATS)
def test_needle_prompts_place_the_key(tmp_path, fmt):
    tok, words = tiny_tokenizer(tmp_path / "tok", chat=True)
    prefix = quality.bos_prefix(tok)
    assert prefix == [0]
    cells = check_needle_prompts(tok, fmt, prefix, quality.encode(tok, " ".join(words)), [300, 600])
    text = tok.decode(cells[0]["ids"])
    if fmt != "chat":  # the reference LM's format: BOS, text, the question it was trained on
        assert cells[0]["ids"][0] == 0 and text.endswith("\nWhat is the pass key? The pass key is")
    else:  # a user turn with the haystack, the answer begun
        assert text.startswith("<|im_start|>user\nThere is a pass key hidden in the text below.")
        assert text.endswith("What is the pass key?<|im_end|>\n<|im_start|>assistant\nThe pass key is")


def test_needle_prompts_refuse_what_does_not_fit(tmp_path):
    tok, words = tiny_tokenizer(tmp_path / "tok")
    hay = quality.encode(tok, " ".join(words))
    with pytest.raises(ValueError, match="no chat template"):
        quality.needle_pieces(tok, "chat", [])
    with pytest.raises(ValueError, match="unknown needle format"):
        quality.needle_pieces(tok, "haiku", [])
    with pytest.raises(ValueError, match="haystack tokens"):
        quality.needle_prompts(tok, "passkey", [0], hay, [10], [50], 1)


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer_config.json").exists(), reason=f"no converted model at {SMOLLM2}")
@pytest.mark.parametrize("fmt", quality.NEEDLE_FORMATS)
def test_needle_prompts_with_smollm2(fmt):
    """The real tokenizer: no BOS, digits one token each, the ChatML template; an 8k prompt of Paul Graham text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    assert quality.bos_prefix(tok) == []
    assert [tok.decode([i]) for i in quality.encode(tok, " 48213")] == [" ", "4", "8", "2", "1", "3"]
    assert quality.answer_matches(tok.decode(quality.encode(tok, " 48213.<|im_end|>")), 48213)
    essays = Path(__file__).resolve().parents[3] / "shared" / "data" / "paul_graham_essays"
    text = "\n\n".join(p.read_text() for p in sorted(essays.glob("*.txt"))) if essays.is_dir() else "Startups. " * 9000
    cells = check_needle_prompts(tok, fmt, [], quality.encode(tok, text), [1024, 8000])
    prompt = tok.decode(cells[-1]["ids"])
    assert f"The pass key is {cells[-1]['key']}. Remember it." in prompt and prompt.endswith("The pass key is")
    if fmt == "chat":
        assert prompt.startswith("<|im_start|>system\n") and "<|im_start|>assistant\nThe pass key is" in prompt


def test_kv_rows_and_their_engines():
    assert set(quality.DEFAULT_KV) <= set(quality.KV) and list(quality.KV)[:2] == ["bf16", "fp8"]
    assert quality.KV["tq4+boundary"] == quality.Cache("CUSTOM", preset="tq4", boundary=True)
    assert quality.KV["tq3-cal"] == quality.Cache("CUSTOM", preset="tq3", calibrated=True)
    assert quality.KV["k5v4-cal+boundary"].calibrated and quality.KV["k5v4-cal+boundary"].boundary
    inp = {"model": "/m", "context": 8192, "prefill_chunk": 64, "kv_cache_gib": 12, "cuda_graphs": False,
           "layer_presets": {"0,1,28,29": "bf16"}}
    bf16 = quality.engine_args("bf16", inp)
    assert bf16["attention_config"] == {"backend": "FLASH_ATTN"} and bf16["kv_cache_dtype"] == "auto"
    assert bf16["max_model_len"] == 8193 and bf16["kv_cache_memory_bytes"] == 12 << 30 and bf16["enforce_eager"]
    assert bf16["long_prefill_token_threshold"] == 64 and bf16["max_num_batched_tokens"] == 256 * 64
    assert "additional_config" not in bf16 and "compilation_config" not in bf16
    in_tree = quality.engine_args("turboquant_4bit_nc", inp)
    assert in_tree["kv_cache_dtype"] == "turboquant_4bit_nc" and "attention_config" not in in_tree
    edge = quality.engine_args("tq4+boundary", dict(inp, cuda_graphs=True))
    assert edge["attention_config"] == {"backend": "CUSTOM"}
    assert edge["additional_config"] == {"turboquant_layer_presets": {"0,1,28,29": "bf16"}}
    assert edge["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert "enforce_eager" not in edge
    files = {"tq3-cal": "/c/tq3.safetensors"}
    assert quality.child_env("tq3-cal", files) == {"TURBOQUANT_PRESET": "tq3",
                                                   "TURBOQUANT_KEY_CALIBRATION": "/c/tq3.safetensors"}
    assert quality.child_env("tq4+boundary", files) == {"TURBOQUANT_PRESET": "tq4"}
    assert quality.child_env("fp8", files) == {} and quality.child_env("calibration", files) == {
        "TURBOQUANT_PRESET": "tq4"}


def test_layer_presets_and_calibration_files(tmp_path):
    assert quality.layer_presets(None, 30) == {"0,1,28,29": "bf16"}
    assert quality.layer_presets("0-1,28-29=bf16;2=k5v4", 30) == {"0-1,28-29": "bf16", "2": "k5v4"}
    assert quality.layer_presets("-2--1=bf16", 30) == {"-2--1": "bf16"}
    for bad in ("30=bf16", "-31=bf16", "2-1=bf16", "0,1=tq9", "a=bf16"):
        with pytest.raises(ValueError):
            quality.layer_presets(bad, 30)
    chosen = ["bf16", "tq4-cal", "tq3-cal", "tq4"]
    one = str(tmp_path / "keys.safetensors")
    assert quality.calibration_files(one, chosen) == {"tq4-cal": one, "tq3-cal": one}
    assert quality.calibration_files(f"tq3-cal={one}", chosen) == {"tq3-cal": one}
    assert quality.calibration_files(None, chosen) == {}
    with pytest.raises(ValueError, match="without -cal"):
        quality.calibration_files(f"tq4={one}", chosen)


def test_books_are_cut_to_their_body(tmp_path):
    book = ("The Project Gutenberg EBook of X\r\nlicence\r\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\r\n"
            "Chapter 1.\r\nIt was a dark night.\r\n*** END OF THIS PROJECT GUTENBERG EBOOK X ***\r\nmore licence\r\n")
    assert quality.book_body(book) == "Chapter 1.\nIt was a dark night."
    assert quality.book_body("plain text\n") == "plain text"
    (tmp_path / "books" / "a").mkdir(parents=True)
    (tmp_path / "books" / "a" / "x.txt").write_text(book)
    (tmp_path / "books" / "y.txt").write_text("Essay.")
    assert quality.read_texts([str(tmp_path / "books")]) == "Chapter 1.\nIt was a dark night.\n\nEssay."
    with pytest.raises(ValueError, match="no text"):
        quality.read_texts([str(tmp_path / "books" / "a" / "none")])


def test_bytes_per_token():
    assert {kv: quality.bytes_formula(kv, 16, 128) for kv in ("bf16", "fp8", "tq4", "tq3", "k4v3", "k3v2", "tq2")} == {
        "bf16": 512, "fp8": 256, "tq4": 136, "tq3": 104, "k4v3": 120, "k3v2": 88, "tq2": 72}
    assert quality.bytes_formula("tq3-cal", 16, 128) == 104  # a key calibration costs no bytes per token
    edges = quality.layer_presets(None, 30)  # SmolLM2: 30 layers of head_dim 64, tq4 72 B, bf16 256 B
    assert quality.bytes_formula("tq4", 30, 64, edges) == 72  # the layer presets are the +boundary rows' only
    assert quality.bytes_formula("tq4+boundary", 30, 64, edges) == pytest.approx((4 * 256 + 26 * 72) / 30)
    assert quality.bytes_formula("tq4+boundary", 30, 64, {"0-1": "tq3"}) == pytest.approx((2 * 56 + 28 * 72) / 30)


def test_bytes_per_token_of_vllm_caches():
    """vLLM 0.33's pages: turboquant_* slots (K: codes + fp16 norm or fp8; V: codes + fp16 scale and zero) with layers
    0, 1, 14, 15 in bf16; the per-token-head caches (TRITON_ATTN) K and V of head_dim int4 / int8 / fp8 plus one fp32
    scale each, in every layer."""
    got = {kv: quality.bytes_formula(kv, 16, 128) for kv in quality.IN_TREE}
    slots = {"turboquant_k8v4": 196, "turboquant_4bit_nc": 134, "turboquant_k3v4_nc": 118, "turboquant_3bit_nc": 102}
    assert got == {**{kv: (4 * 512 + 12 * s) / 16 for kv, s in slots.items()},
                   "int4_per_token_head": 136, "int8_per_token_head": 264, "fp8_per_token_head": 264}
    assert 512 / got["turboquant_4bit_nc"] == pytest.approx(2.24, abs=0.01)  # the kit's measured 2.24x KV tokens
    assert quality.bytes_formula("int4_per_token_head", 30, 64) == 72  # SmolLM2: tq4's bytes


def test_vllm_cache_rows():
    """vLLM's compressed caches that run on Hopper are rows by their kv_cache_dtype, in the default run; the
    per-token-head ones ask for TRITON_ATTN, the turboquant_* leave the pick to vLLM (their bf16 boundary layers
    need FLASH_ATTN); those that do not run are no row but a line of the report."""
    assert quality.KV["int4_per_token_head"] == quality.Cache("TRITON_ATTN", "int4_per_token_head")
    assert quality.KV["turboquant_k3v4_nc"] == quality.Cache(None, "turboquant_k3v4_nc")
    assert set(quality.IN_TREE) <= set(quality.DEFAULT_KV)
    inp = dict(model="m", context=8192, prefill_chunk=64, kv_cache_gib=1, cuda_graphs=False, layer_presets={})
    assert quality.engine_args("fp8_per_token_head", inp)["attention_config"] == {"backend": "TRITON_ATTN"}
    assert quality.engine_args("fp8_per_token_head", inp)["kv_cache_dtype"] == "fp8_per_token_head"
    assert "attention_config" not in quality.engine_args("turboquant_4bit_nc", inp)
    for name, _ in common.VLLM_KV_NOT_ON_HOPPER:
        assert name not in quality.KV


def test_pareto_front():
    pts = [(512, 0.0), (256, 0.1), (136, 0.5), (136, 0.7), (104, 2.0), (200, 1.0), (256, 0.1)]
    assert [pts[i] for i in quality.pareto(pts)] == [(104, 2.0), (136, 0.5), (256, 0.1), (256, 0.1), (512, 0.0)]


def test_expected_time():
    inp = {"wikitext2": [[0] * 100] * 3, "heldout": [], "kl_prompts": [[0] * 10] * 2, "kl_tokens": 5,
           "needles": {"passkey": [{"ids": [0] * 50}] * 4, "repeat": [{"ids": [0] * 50}] * 4}}
    needle = 4 * (50 + quality.NEEDLE_TOKENS)
    assert quality.job_tokens(inp) == 300 + 2 * 15 + needle
    assert quality.job_tokens(inp, 2) == quality.job_tokens(inp) + needle  # bf16 runs every format
    assert quality.expected_seconds(4 * 10**6, 12, 4, True) == pytest.approx(
        quality.IMPORT_SECONDS + 3 * quality.ENGINE_SECONDS + 10**6 / quality.TOKENS_PER_SECOND
        + quality.IN_TREE_COMPILE_SECONDS)


def model_dir(tmp_path: Path, chat: bool = False, context: int = 64) -> Path:
    model = tmp_path / "model"
    tiny_tokenizer(model, chat=chat)
    (model / "config.json").write_text(json.dumps({
        "max_position_embeddings": context, "num_hidden_layers": 2, "hidden_size": 1024, "num_attention_heads": 8,
        "head_dim": 128, "num_key_value_heads": 2, "architectures": ["LlamaForCausalLM"], "vocab_size": 400}))
    return model


def test_prepare_tokenizes_windows_and_kl_prompts(tmp_path):
    model = model_dir(tmp_path)
    tok, words = tiny_tokenizer(tmp_path / "tok")
    (tmp_path / "wiki.txt").write_text(" ".join(words))
    held = np.arange(3, 2003, dtype=np.uint16)
    held.tofile(tmp_path / "val.bin")
    args = quality.parser().parse_args([
        "--model", str(model), "--wikitext", str(tmp_path / "wiki.txt"), "--heldout", str(tmp_path / "val.bin"),
        "--heldout-windows", "3", "--kl-prompts", "5", "--kl-prompt-len", "20,30", "--kl-tokens", "16"])
    inp = quality.prepare(args)
    assert (inp["prefix"], inp["scored_from"], inp["context"], inp["head_dim"], inp["num_kv_heads"]) == (
        [0], 1, 64, 128, 2)
    assert inp["layer_presets"] == {"0,1": "bf16"}  # the first and last two of 2 layers
    assert inp["heldout"] == [[0] + held[i * 63:(i + 1) * 63].tolist() for i in range(3)]
    text_ids = quality.encode(tok, " ".join(words))
    assert [t for w in inp["wikitext2"] for t in w[1:]] == text_ids[: len(inp["wikitext2"]) * 63]
    for p in inp["kl_prompts"]:  # BOS + a stretch of the held-out ids (consecutive values here)
        assert 20 <= len(p) <= 30 and p[0] == 0 and p[1:] == list(range(p[1], p[1] + len(p) - 1))
    assert inp["needles"] == {}


def test_prepare_takes_kl_prompts_from_books_and_builds_needles(tmp_path):
    model = model_dir(tmp_path, chat=True, context=512)
    tok, words = tiny_tokenizer(tmp_path / "tok")
    (tmp_path / "books").mkdir()
    book = " ".join(f"b{i % 50}" for i in range(3000))
    (tmp_path / "books" / "b.txt").write_text(f"licence\n*** START OF X ***\n{book}\n*** END OF X ***\nlicence")
    (tmp_path / "essays").mkdir()
    (tmp_path / "essays" / "e.txt").write_text(" ".join(words))
    argv = ["--model", str(model), "--kl-prompts", "4", "--kl-prompt-len", "10,20", "--kl-tokens", "8",
            "--haystack", str(tmp_path / "essays"), "--lengths", "200,300", "--depths", "0,100", "--needles", "2",
            "--needle-format", "chat,passkey", "--boundary-layers", "1=bf16"]
    inp = quality.prepare(quality.parser().parse_args(argv + ["--kl-text", str(tmp_path / "books")]))
    book_ids = quality.encode(tok, book)
    starts = {i for i in range(len(book_ids)) for p in inp["kl_prompts"] if book_ids[i:i + len(p) - 1] == p[1:]}
    assert len(inp["kl_prompts"]) == 4 and len(starts) >= 4  # stretches of the book's body, BOS first
    assert list(inp["needles"]) == ["chat", "passkey"] and all(len(c) == 2 * 2 * 2 for c in inp["needles"].values())
    assert inp["layer_presets"] == {"1": "bf16"}
    with pytest.raises(AssertionError, match="--kl-text or --heldout"):  # never the WikiText-2 that PPL scores
        quality.prepare(quality.parser().parse_args(argv))


class FakeLLM:
    """Stands in for vllm.LLM: every prompt token at log-prob -1 under bf16 (FLASH_ATTN, auto), -1.5 under the other
    caches; bf16 samples token 7; greedy decoding says the pass key, in the repeat format only."""

    def __init__(self, **kwargs):
        from transformers import AutoTokenizer

        FakeLLM.kwargs = kwargs
        self.tok = AutoTokenizer.from_pretrained(kwargs["model"])
        self.logprob = -1.0 if kwargs.get("attention_config") == {"backend": "FLASH_ATTN"} else -1.5
        cache = SimpleNamespace(kv_cache_size_tokens=160)
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache))

    def collective_rpc(self, fn):
        return [{"model.layers.1.self_attn.attn": 64.0, "model.layers.0.self_attn.attn": 32.0}]

    def generate(self, prompts, params, use_tqdm):
        outs = []
        for i, prompt in enumerate(prompts):
            ids, sp = prompt["prompt_token_ids"], params[i] if isinstance(params, list) else params
            scored = [None] + [{t: SimpleNamespace(logprob=self.logprob)} for t in ids[1:]]
            text = self.tok.decode(ids)
            key = re.search(r"pass key is (\d+)", text)[1] if "grass is green" in text else "00000"
            tokens = [7] * sp.max_tokens if sp.temperature == 1.0 else quality.encode(self.tok, f" {key}.")
            outs.append(SimpleNamespace(prompt_logprobs=scored if sp.prompt_logprobs == 0 else None,
                                        outputs=[SimpleNamespace(token_ids=tokens)]))
        return outs


def fake_vllm(monkeypatch) -> None:
    def sampling(**kwargs):
        return SimpleNamespace(**{"prompt_logprobs": None, "temperature": 1.0, **kwargs})

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=FakeLLM, SamplingParams=sampling))


def child_rows(capsys) -> list[dict]:
    return [json.loads(line[len(quality.ROW_TAG):]) for line in capsys.readouterr().out.splitlines()
            if line.startswith(quality.ROW_TAG)]


def test_evaluate_hands_bf16_reference_and_needle_format_to_the_others(tmp_path, monkeypatch, capsys):
    fake_vllm(monkeypatch)
    model = model_dir(tmp_path, context=512)
    _, words = tiny_tokenizer(tmp_path / "tok")
    for name, text in (("wiki.txt", " ".join(words)), ("books/b.txt", "b1 b2 b3 " * 800),
                       ("essays/e.txt", " ".join(words))):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    args = quality.parser().parse_args([
        "--model", str(model), "--wikitext", str(tmp_path / "wiki.txt"), "--kl-text", str(tmp_path / "books"),
        "--kl-prompts", "3", "--kl-tokens", "16", "--haystack", str(tmp_path / "essays"), "--lengths", "200,300",
        "--depths", "0,100", "--needles", "2"])
    work = tmp_path / "work"
    work.mkdir()
    inp = dict(quality.prepare(args), bf16_pending=True)
    (work / "inputs.json").write_text(json.dumps(inp))

    quality.evaluate("bf16", work)
    bf16 = child_rows(capsys)[-1]
    assert list(bf16["seconds_by_step"]) == ["startup", "kl", "needle", "wikitext2"]  # what the others wait for first
    assert FakeLLM.kwargs["kv_cache_memory_bytes"] == 12 << 30 and FakeLLM.kwargs["max_model_len"] == 513
    assert bf16["bytes_per_layer"] == [32.0, 64.0] and bf16["kv_tokens"] == 160
    assert bf16["ppl_wikitext2"] == pytest.approx(math.e) and bf16["kl_vs_bf16"] == 0
    assert bf16["needle_by_format"] == {"passkey": 0.0, "repeat": 1.0} and bf16["needle_format"] == "repeat"
    assert json.loads((work / quality.NEEDLE_FORMAT).read_text()) == {"format": "repeat"}
    ref = json.loads((work / quality.KL_REFERENCE).read_text())
    assert ref["prompts"] == inp["kl_prompts"] and all(s[-16:] == [7] * 16 for s in ref["sequences"])

    quality.evaluate("tq4", work)
    tq4 = child_rows(capsys)[-1]
    assert list(tq4["seconds_by_step"]) == ["startup", "wikitext2", "kl", "needle"]
    assert tq4["kl_vs_bf16"] == pytest.approx(0.5) and tq4["kl_tokens"] == 3 * 16
    assert tq4["needle_by_format"] == {"repeat": 1.0} and tq4["needle_grid"]["accuracy"] == [[1.0, 1.0]] * 2
    assert FakeLLM.kwargs["attention_config"] == {"backend": "CUSTOM"}

    for name in (quality.KL_REFERENCE, quality.NEEDLE_FORMAT):  # bf16 ended without them: no wait, no KL
        (work / name).unlink()
    (work / quality.BF16_ENDED).touch()
    quality.evaluate("fp8", work)
    fp8 = child_rows(capsys)[-1]
    assert "kl_vs_bf16" not in fp8 and fp8["needle_format"] == "passkey" and fp8["needle_accuracy"] == 0
    assert fp8["needle_misses"][0]["answer"] == " 00000."


def test_fit_calibration_gives_calibrate_a_fixed_kv_budget(tmp_path, monkeypatch):
    seen = {}

    def llm(**kwargs):
        seen.update(kwargs)
        raise RuntimeError("no GPU")

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=llm, SamplingParams=None))
    monkeypatch.setenv("TURBOQUANT_COLLECT_KEY_STATISTICS", "")  # calibrate() sets these for its engine
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    (tmp_path / "inputs.json").write_text(json.dumps({"model": "/m", "context": 8192, "calibration_tokens": 1000}))
    (tmp_path / quality.CALIBRATION_TEXT).write_text("text")
    with pytest.raises(RuntimeError, match="no GPU"):
        quality.fit_calibration(tmp_path)
    assert seen["kv_cache_memory_bytes"] == 2 << 30 and seen["gpu_memory_utilization"] == quality.STARTUP_CHECK
    assert seen["max_model_len"] == 8193 and seen["attention_config"] == {"backend": "CUSTOM"}


def results_doc() -> dict:
    grid = {"lengths": [1024, 2048, 4096, 8000], "depths": [0, 25, 50, 75, 100], "per_cell": 10,
            "accuracy": [[1.0, 1.0, 0.9, 0.8]] * 5}

    def row(kv, b, ppl, kl, needle=1.0):
        nll = [math.log(ppl) + d for d in (-0.01, 0.0, 0.01)]
        return {"kv": kv, "bytes_per_token_per_head": b, "ppl_wikitext2": ppl, "wikitext2_window_nll": nll,
                "needle_accuracy": needle, "needle_grid": grid, "kl_vs_bf16": kl, "kl_stderr": kl / 10,
                "kv_tokens": 1000, "seconds": 60.0}

    rows = [row("bf16", 256, 20.0, 0.0), row("fp8", 128, 20.1, 0.005),
            row("turboquant_4bit_nc", 150, 20.6, 0.02), row("turboquant_3bit_nc", 145, 21.0, 0.05),
            row("tq4", 72, 20.15, 0.009), row("tq4+boundary", 84, 20.08, 0.004), row("tq4-cal", 72, 20.12, 0.007),
            row("tq3", 56, 20.7, 0.05, 0.9),
            {"kv": "tq3-cal", "bytes_per_token_per_head": 56, "seconds": 12.0,
             "error": "Traceback\nRuntimeError: boom"}]
    settings = {"context": 8192, "bos": False, "num_layers": 30, "head_dim": 64, "num_attention_heads": 9,
                "num_kv_heads": 3, "architecture": "LlamaForCausalLM", "vocab_size": 49152, "wikitext2_windows": 3,
                "heldout_windows": 0, "kl_prompts": 32, "kl_prompt_len": "2048-4096", "kl_tokens": 512,
                "kl_text": ["doyle.txt", "wells.txt"], "needle_lengths": "1024,2048,4096,8000",
                "needle_depths": "0,25,50,75,100", "needles_per_cell": 10, "needle_formats": ["passkey"],
                "prefill_chunk": 64, "kv_cache_gib": 12, "parallel": 4, "boundary_layers": {"0,1,28,29": "bf16"}}
    return {"model": "smollm2-135m", "rows": rows, "vllm": "0.25.0", "device": "NVIDIA H100 80GB HBM3",
            "settings": settings, "calibration_fit": {"tokens": 262144, "window": 8192,
                                                      "text": ["verne.txt"], "preset": "tq4"}}


def test_targets_pass_and_fail():
    assert quality.targets(results_doc()["rows"]) == [
        ("tq4: PPL ≤ +1% vs bf16 and below turboquant_4bit_nc", True, "tq4 +0.75%, turboquant_4bit_nc +3.00%"),
        ("tq4-cal: PPL ≤ +1% vs bf16 and below turboquant_4bit_nc", True,
         "tq4-cal +0.60%, turboquant_4bit_nc +3.00%"),
        ("tq3: PPL ≤ +3% vs bf16 and below turboquant_3bit_nc", False, "tq3 +3.50%, turboquant_3bit_nc +5.00%"),
        ("tq3-cal: PPL ≤ +3% vs bf16 and below turboquant_3bit_nc", None, "tq3-cal missing, turboquant_3bit_nc +5.00%"),
        ("needle: every row of ours ≥ bf16's", False, "bf16 1.000; below it: tq3 0.900"),
        ("tq4: KL ≤ 2x fp8's", True, "tq4 0.009, fp8 0.005 (1.80x)"),
        ("tq4-cal: KL ≤ 2x fp8's", True, "tq4-cal 0.007, fp8 0.005 (1.40x)"),
        ("tq4+boundary: PPL ≤ +0.5% at ≤ 1.25x tq4's bytes", True, "+0.40% at 1.17x tq4's bytes (84.0 vs 72.0 B)")]
    rows = [r for r in results_doc()["rows"] if r["kv"] in ("bf16", "tq4")]  # the others missing: n/a
    assert [passed for _, passed, _ in quality.targets(rows)] == [None, None, True, None, None]


def test_a_row_failed_part_way_keeps_its_figures_for_the_targets():
    rows = [dict(r, error="TimeoutError: killed after 420 s") if r["kv"] == "turboquant_4bit_nc" else r
            for r in results_doc()["rows"]]
    assert quality.targets(rows)[0] == ("tq4: PPL ≤ +1% vs bf16 and below turboquant_4bit_nc", True,
                                        "tq4 +0.75%, turboquant_4bit_nc +3.00%")


def test_markdown_table():
    md = quality.markdown(results_doc())
    assert md.startswith("## smollm2-135m: KV cache quality in vLLM\n")
    assert "| tq4 | 72.0 | 1,000 | 20.150 | +0.75% ± 0.00 | 1.000 | 0.009 ± 0.0009 | 60 |" in md
    assert "| tq3-cal (failed) | 56.0 |" in md and "tq3-cal failed: `RuntimeError: boom`" in md
    assert ("| tq4: PPL ≤ +1% vs bf16 and below turboquant_4bit_nc | PASS | tq4 +0.75%, turboquant_4bit_nc +3.00% |"
            in md)
    assert "| tq3: PPL ≤ +3% vs bf16 and below turboquant_3bit_nc | FAIL |" in md
    assert "- `ultraquant_4bit`: ROCm only" in md and "- `nvfp4`: FLASHINFER only" in md  # vLLM's caches left out
    assert "LlamaForCausalLM: 30 layers, 9 query / 3 KV heads of dim 64" in md and "context 8192" in md
    assert "KV cache of 12 GiB" in md and "from doyle.txt, wells.txt (no PPL" in md
    assert "fitted in this run (262144 tokens of verne.txt in windows of 8192, tq4's cache)." in md
    assert "Needle: lengths 1024,2048,4096,8000, depths 0,25,50,75,100 %, 10 keys per cell, format passkey," in md
    assert '*+boundary: --additional-config turboquant_layer_presets = `{"0,1,28,29": "bf16"}`' in md
    assert "+2.71%" in md and "0.997" in md and "PPL held-out" not in md
    assert "Measured by" not in md  # one call measured every row
    doc = results_doc()
    doc["rows"][2]["command"] = "an earlier call"  # merged (--merge) from another run
    assert "- Measured by `an earlier call`: turboquant_4bit_nc." in quality.markdown(doc)
    doc["rows"][0].update(needle_accuracy=0.6, needle_format="repeat", needle_by_format={"passkey": 0.5, "repeat": 0.6})
    assert "bf16 finds only 0.600 of the keys" in quality.markdown(doc)
    assert "format repeat (bf16's best of passkey 0.500, repeat 0.600)" in quality.markdown(doc)


def test_markdown_of_the_reference_lm_file():
    """The reference LM's quality.json (held-out PPL, bytes_per_token, per-child GPU shares) still renders."""
    doc = json.loads((quality.common.RESULTS / "quality.json").read_text())
    md = quality.markdown(doc)
    assert "| tq4 | 136.0 | 8,525,632 | 233.265 | +1.67% | 76.701 (+0.96%) | 1.000 | 0.0229 ± 0.0018 | 55 |" in md
    assert "each with gpu_memory_utilization 0.17" in md and "*-cal: the same preset with the key calibration" in md


@pytest.mark.parametrize("name", ["quality", "smollm2-135m"])
def test_report_writes_markdown_and_figures_to_out(tmp_path, name, capsys):
    src = tmp_path / f"{name}.json"
    src.write_text(json.dumps(results_doc()))
    quality.main(["--report", str(src), "--out", str(tmp_path / "out" / name)])
    assert (tmp_path / "out" / f"{name}.md").read_text() == quality.markdown(results_doc()) == capsys.readouterr().out
    heatmaps = [f"{name}/needle/{r['kv']}.png" for r in results_doc()["rows"] if r.get("needle_grid")]
    assert len(heatmaps) == 8 and sorted(p.name for p in (tmp_path / "out" / name / "needle").iterdir()) == sorted(
        h.split("/")[-1] for h in heatmaps)  # one per KV cache with a grid (the failed one has none)
    for path in (f"{name}.png", f"{name}/needle.png", *heatmaps):
        assert (tmp_path / "out" / path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["quality.json", "quality/smollm2-135m.json"])
def test_report_of_a_committed_result_prints_it_and_writes_nothing(tmp_path, name, capsys):
    """--report only reads: the table goes to stdout, the result file and its folder stay byte for byte."""
    committed = quality.common.RESULTS / name
    copy = tmp_path / name
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_bytes(committed.read_bytes())
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    quality.main(["--report", str(copy)])
    out = capsys.readouterr().out
    doc = json.loads(committed.read_text())
    assert out.endswith(quality.markdown(doc)) and "| tq4 |" in out
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert copy.read_bytes() == committed.read_bytes()


def test_scheduler_keeps_order_slots_and_needs():
    def run_jobs(sched, jobs):
        times = {}

        def job(name, seconds):
            assert sched.start(name)
            times[name] = [time.monotonic()]
            time.sleep(seconds)
            times[name].append(time.monotonic())
            sched.end(name)

        threads = [threading.Thread(target=job, args=a) for a in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return times

    sched = quality.Scheduler(["bf16", "calibration", "fp8", "tq4"], 1)
    run_jobs(sched, [("tq4", 0.01), ("fp8", 0.01), ("calibration", 0.01), ("bf16", 0.05)])
    assert sched.started == ["bf16", "calibration", "fp8", "tq4"]  # in order, whoever is ready first
    sched = quality.Scheduler(["calibration", "tq4-cal", "fp8"], 2, {"tq4-cal": {"calibration"}})
    times = run_jobs(sched, [("calibration", 0.5), ("tq4-cal", 0.01), ("fp8", 0.01)])
    assert sched.started == ["calibration", "fp8", "tq4-cal"]  # fp8 passed the row waiting for the calibration
    assert times["fp8"][0] < times["calibration"][1] <= times["tq4-cal"][0]
    late = quality.Scheduler(["tq4"], 1, deadline=time.monotonic() - 1)
    assert not late.start("tq4") and not late.pending and not late.started


# Stands in for `quality.py --child KV`: says READY, waits for its go, then appends its events to a file *before*
# the parent can see them happen (its first row, its exit), so the file's order is an order the parent's scheduling
# must respect.
FAKE_CHILD = r"""
import json, os, sys, time
kv, events = sys.argv[1], sys.argv[2]

def event(what):
    fd = os.open(events, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, f"{what} {kv}\n".encode())
    os.close(fd)

print("QUALITY_READY", flush=True)
if not sys.stdin.readline():
    sys.exit("no go")
row = dict(kv=kv, preset=os.environ.get("TURBOQUANT_PRESET"), calibration=os.environ.get("TURBOQUANT_KEY_CALIBRATION"))
event("start")
time.sleep(0.1)  # the engine's startup
if kv == "k5v4":
    event("end")
    sys.exit("RuntimeError: no engine")
event("up")
print("QUALITY_ROW " + json.dumps(row), flush=True)
time.sleep(float(os.environ.get("FAKE_SECONDS", "0.5")))  # the metrics
row["ppl_wikitext2"] = 20.0
if kv == "calibration":
    row = dict(kv=kv, tokens=1000, window=64)
print("QUALITY_ROW " + json.dumps(row), flush=True)
event("end")
if kv == "tq2":
    sys.exit("RuntimeError: boom")
"""


def fake_inputs(args) -> dict:
    return {"context": 64, "prefix": [0], "num_layers": 2, "head_dim": 128, "num_attention_heads": 8,
            "num_kv_heads": 2, "architecture": "LlamaForCausalLM", "vocab_size": 300, "wikitext2": [], "heldout": [],
            "kl_prompts": [], "needles": {}, "kl_tokens": 16,
            "layer_presets": quality.layer_presets(args.boundary_layers, 2)}


@pytest.fixture
def fake_children(tmp_path, monkeypatch):
    events = tmp_path / "events"
    monkeypatch.setattr(quality, "child_command", lambda kv, work: [sys.executable, "-c", FAKE_CHILD, kv, str(events)])
    monkeypatch.setattr(quality, "prepare", fake_inputs)
    monkeypatch.setattr(quality, "metadata", SimpleNamespace(version=lambda name: "test"))
    return events


def test_parallel_run_schedules_children(tmp_path, fake_children, capsys):
    chosen, parallel = ["tq2", "k5v4", "tq3-cal", "tq3", "fp8", "bf16", "tq4-cal", "tq4+boundary", "k4v3"], 3
    out = tmp_path / "quality.json"
    (tmp_path / "book.txt").write_text("*** START OF X ***\ncalibration text\n*** END OF X ***\n")
    quality.run(quality.parser().parse_args([
        "--model", str(tmp_path / "ref-llama"), "--kv", ",".join(chosen), "--out", str(out),
        "--work", str(tmp_path / "work"), "--parallel", str(parallel), "--calibration-text", str(tmp_path / "book.txt"),
        "--key-calibration", f"tq4-cal={tmp_path / 'keys.safetensors'}"]))

    running, up, widest = set(), set(), 0
    lines = [line.split() for line in fake_children.read_text().splitlines()]
    starts = [kv for what, kv in lines if what == "start"]
    doc = json.loads(out.read_text())
    assert doc["settings"]["start_order"][:3] == ["bf16", "calibration", "fp8"]  # bf16 first: the others' KL waits
    assert lines.index(["start", "tq3-cal"]) > lines.index(["end", "calibration"])  # its calibration fitted first
    for what, kv in lines:
        if what == "start":
            running.add(kv)
            widest = max(widest, len(running))
        elif what == "up":
            up.add(kv)
        else:
            running.remove(kv)
    assert widest == parallel and not running and sorted(starts) == sorted(chosen + ["calibration"])
    work = tmp_path / "work"
    assert (work / "bf16.ended").exists() and (work / "calibration.txt").read_text() == "calibration text"

    rows = {r["kv"]: r for r in doc["rows"]}
    assert list(rows) == [kv for kv in quality.KV if kv in chosen]
    assert "boom" in rows["tq2"]["error"] and rows["tq2"]["ppl_wikitext2"] == 20.0  # failed after its last row
    assert rows["k5v4"] == {"kv": "k5v4", "error": "RuntimeError: no engine", "seconds": rows["k5v4"]["seconds"],
                            "bytes_per_token_formula": 152, "bytes_per_token_per_head": 152,
                            "command": rows["k5v4"]["command"]}  # no row: the formula's bytes
    fitted = str(work / "key-calibration.safetensors")
    assert rows["tq3-cal"]["calibration"] == rows["tq3-cal"]["key_calibration"] == fitted
    assert rows["tq4-cal"]["calibration"] == str(tmp_path / "keys.safetensors")  # its own file, not the fitted one
    assert rows["tq4+boundary"]["preset"] == "tq4" and rows["fp8"]["preset"] is None
    assert rows["tq4+boundary"]["bytes_per_token_formula"] == 512  # both layers in bf16 by default
    assert doc["calibration_fit"]["tokens"] == 1000 and doc["calibration_fit"]["preset"] == "tq4"
    assert doc["calibration_fit"]["text"] == ["book.txt"] and doc["settings"]["kl_text"] == []
    assert all(r["command"].startswith("python -m benchmarks quality") for r in rows.values())
    assert doc["meta"]["command"] == rows["bf16"]["command"] and "commit" in doc["meta"]  # the call's provenance
    assert all("error" not in r and r["ppl_wikitext2"] == 20.0 for kv, r in rows.items() if kv not in ("tq2", "k5v4"))
    assert doc["settings"]["parallel"] == parallel and doc["settings"]["kv_cache_gib"] == 12
    log = quality.children_log(out, None).read_text()
    assert quality.children_log(out, None) == tmp_path / "quality" / "cpu-children.log"
    assert all(f"==== {kv} (rc {1 if kv in ('tq2', 'k5v4') else 0})" in log for kv in chosen + ["calibration"])
    printed = capsys.readouterr().out
    assert printed.startswith("10 jobs (bf16, calibration, fp8, ") and "expected ~" in printed
    assert printed.endswith(quality.markdown(doc) + "\n") and "3 engines ran at once" in printed
    assert (tmp_path / "quality.md").read_text().endswith(quality.markdown(doc))


def test_time_budget_kills_and_skips(tmp_path, fake_children, monkeypatch):
    monkeypatch.setenv("FAKE_SECONDS", "30")
    out = tmp_path / "smollm2.json"
    t0 = time.monotonic()
    quality.run(quality.parser().parse_args([
        "--model", str(tmp_path / "smollm2"), "--kv", "bf16,fp8,tq4", "--out", str(out), "--work",
        str(tmp_path / "work"), "--parallel", "2", "--time-budget", "3"]))
    assert time.monotonic() - t0 < 15
    rows = {r["kv"]: r for r in json.loads(out.read_text())["rows"]}
    assert "killed after" in rows["bf16"]["error"] and "killed after" in rows["fp8"]["error"]
    assert rows["tq4"]["error"] == "TimeoutError: not started within --time-budget"
    assert "tq4" not in fake_children.read_text()


def test_child_timeout_kills_it_and_keeps_its_rows(tmp_path, monkeypatch):
    script = ("import sys, time; print('QUALITY_READY', flush=True); sys.stdin.readline(); "
              "print('QUALITY_ROW {\"kv\": \"tq4\"}', flush=True); time.sleep(60)")
    monkeypatch.setattr(quality, "child_command", lambda kv, work: [sys.executable, "-c", script])
    sched = quality.Scheduler(["tq4"], 1)
    stdout, stderr, rc, seconds = quality.child("tq4", tmp_path, {}, 1.0, sched)
    assert stdout == 'QUALITY_READY\nQUALITY_ROW {"kv": "tq4"}\n' and rc == -9 and 1 <= seconds < 5
    assert stderr.endswith("TimeoutError: killed after 1 s") and sched.ended == {"tq4"}


def test_child_that_dies_before_its_turn_ends(tmp_path, monkeypatch):
    script = "raise SystemExit('no vllm')"
    monkeypatch.setattr(quality, "child_command", lambda kv, work: [sys.executable, "-c", script])
    sched = quality.Scheduler(["bf16", "fp8"], 1)
    _, stderr, rc, _ = quality.child("bf16", tmp_path, {}, 0, sched)
    assert rc == 1 and "no vllm" in stderr and sched.pending == ["fp8"] and sched.ended == {"bf16"}
