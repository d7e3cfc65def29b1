import contextlib
import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from reference_lm import model as model_mod
from reference_lm import prepare_data, train
from reference_lm.model import MAX_SHARD_BYTES, Llama, ModelConfig, plan_shards, save_hf, write_safetensors
from reference_lm.passkey import PasskeyCodec

ROOT = Path(__file__).resolve().parents[2]
SIZE_LIMIT = 48_000_000  # bytes of safetensors for the full model


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """A --tiny run on the tiny corpus: (model, output dir)."""
    out = tmp_path_factory.mktemp("tiny_model")
    return train.main(["--data", str(data_dir), "--out", str(out), "--tiny"]), out


def hf_logits(path, ids):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids).logits


def as_saved(model: Llama) -> Llama:
    """The model with its weights rounded to bf16, as the checkpoint holds them, computing in fp32."""
    m = copy.deepcopy(model)
    for p in m.parameters():
        p.data = p.data.to(torch.bfloat16).float()
    return m


def test_prepare_data_splits_by_book_and_drops_licence(data_dir, corpus, tokenizer):
    meta = json.loads((data_dir / "meta.json").read_text())
    _, bodies = corpus
    assert sorted(meta["train_books"] + meta["val_books"]) == sorted(bodies)
    assert not set(meta["train_books"]) & set(meta["val_books"]) and len(meta["val_books"]) == 2
    train_ids = np.fromfile(data_dir / "train.bin", np.uint16)
    val_ids = np.fromfile(data_dir / "val.bin", np.uint16)
    assert (meta["train_tokens"], meta["val_tokens"]) == (train_ids.size, val_ids.size)
    eos = meta["eos_id"]
    assert (val_ids == eos).sum() == 2 and val_ids[-1] == eos and (train_ids == eos).sum() == 4
    text = tokenizer.decode(val_ids.tolist())
    assert "LICENCE" not in text and "\r" not in text
    assert text.startswith(prepare_data.clean(bodies[meta["val_books"][0]])[:200])


def test_clean_unwraps_lines_and_keeps_paragraphs():
    text = "  One two\r\nthree.\r\n\r\n\r\n\r\nFour\r\n  five. \r\n"
    assert prepare_data.clean(text) == "One two three.\n\nFour five."


def test_tokenizer_for_transformers(trained):
    """The saved tokenizer loads with AutoTokenizer and prepends BOS, as every training sequence starts."""
    from transformers import AutoTokenizer

    _, out = trained
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("The pass key is 48213.")["input_ids"]
    assert ids[0] == tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert tok.decode(ids, skip_special_tokens=True) == "The pass key is 48213."
    assert [tok.convert_ids_to_tokens(i) for i in ids[-6:-1]] == list("48213")


def test_checkpoint_loads_in_transformers_with_the_same_logits(trained):
    model, out = trained
    ids = torch.randint(0, model.config.vocab_size, (2, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = as_saved(model)(ids)
    torch.testing.assert_close(hf_logits(out, ids), ours, atol=1e-3, rtol=1e-4)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["head_dim"] == 16 and cfg["tie_word_embeddings"]


def test_rope_and_names_match_transformers_on_a_sharp_model(tmp_path, monkeypatch):
    """Large random weights make attention position-sensitive, so a wrong RoPE convention shows."""
    torch.manual_seed(0)
    model = Llama(ModelConfig(vocab_size=300, **train.TINY_MODEL))
    model.init_weights(std=0.3)
    save_hf(model, tmp_path, 0, 1)
    ids = torch.randint(0, 300, (2, 256))
    ref = as_saved(model)
    with torch.no_grad():
        ours = ref(ids)
        hf = hf_logits(tmp_path, ids)
    torch.testing.assert_close(hf, ours, atol=1e-3, rtol=1e-4)

    def interleaved(x, cos, sin):  # GPT-J style pairs: the convention HF Llama does not use
        x1, x2 = x[..., 0::2], x[..., 1::2]
        c, s = cos[..., ::2].to(x.dtype), sin[..., ::2].to(x.dtype)
        return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2)

    monkeypatch.setattr(model_mod, "apply_rope", interleaved)
    with torch.no_grad():
        assert (ref(ids) - hf).abs().max() > 0.1


def test_training_outputs(trained):
    _, out = trained
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps_done"] == train.TINY_TRAIN["steps"] and not log["stopped_early"]
    assert log["tokens_seen"] == 6 * 4 * 256 and log["command"].endswith("--tiny")
    assert [e["step"] for e in log["evals"]] == [3, 6]
    assert set(log["final"]["passkey"]) == {"64", "128", "192", "240", "all"}
    assert log["history"][-1]["loss"] < log["history"][0]["loss"]
    card = (out / "README.md").read_text()
    assert "$" not in card and "Stopped early" not in card and log["command"] in card
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors.index.json"):
        assert (out / name).exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(Llama(ModelConfig(vocab_size=400, **train.TINY_MODEL)).state_dict())
    assert "lm_head.weight" not in index["weight_map"]  # tied


def test_train_needs_only_torch_and_numpy(data_dir, tmp_path):
    """The GPU machine has torch and numpy only: block the other packages and run the script."""
    code = (
        "import runpy, sys; sys.modules.update(dict.fromkeys(['tokenizers', 'safetensors', 'transformers', 'vllm']));"
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    script = ROOT / "reference_lm" / "train.py"
    args = [str(script), "--data", str(data_dir), "--out", str(tmp_path), "--tiny", "--steps", "2"]
    subprocess.run([sys.executable, "-c", code, *args], check=True, cwd=tmp_path, capture_output=True)
    assert json.loads((tmp_path / "train_log.json").read_text())["steps_done"] == 2


def test_max_minutes_stops_early_and_says_so(data_dir, tmp_path):
    train.main(["--data", str(data_dir), "--out", str(tmp_path), "--tiny", "--max-minutes", "0"])
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert log["stopped_early"] and log["steps_done"] == 1
    assert "Stopped early" in (tmp_path / "README.md").read_text()
    assert list(tmp_path.glob("model-*.safetensors"))


def test_full_model_fits_the_size_budget():
    with torch.device("meta"):
        full = Llama(ModelConfig())
    c = full.config
    assert (c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.max_position_embeddings) == (128, 8, 2, 4096)
    assert c.num_hidden_layers >= 6 and train.TrainConfig.seq_len == 4096
    params = sum(p.numel() for p in full.parameters())
    assert params == 21_502_464
    sizes = {k: 2 * v.numel() for k, v in full.state_dict().items()}
    assert sum(sizes.values()) <= SIZE_LIMIT - 4_000_000  # keep a margin
    shards = plan_shards(sizes)
    assert all(sum(sizes[k] for k in s) + model_mod.HEADER_ROOM <= MAX_SHARD_BYTES for s in shards)
    assert sorted(k for s in shards for k in s) == sorted(sizes)


def test_shards_are_safetensors_within_the_limit(tmp_path):
    from safetensors.torch import load_file

    tensors = {"a": torch.randn(3, 5).bfloat16(), "b": torch.randn(7), "c": torch.arange(6.0).half().view(2, 3)}
    write_safetensors(tmp_path / "x.safetensors", tensors)
    back = load_file(tmp_path / "x.safetensors")
    assert set(back) == set(tensors)
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())
    sizes = {"x": 6_000_000, "y": 6_000_000, "z": 6_000_000}
    assert plan_shards(sizes) == [["x", "y"], ["z"]]
    with pytest.raises(ValueError):
        plan_shards({"huge": MAX_SHARD_BYTES})


def test_passkey_batches(data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    codec = PasskeyCodec.from_json(meta["passkey"])
    tokens = np.fromfile(data_dir / "train.bin", np.uint16)
    c = train.TrainConfig(**{**train.TINY_TRAIN, "passkey_fraction": 1.0, "batch_size": 16})
    seqs, weights = train.sample_batch(tokens, codec, c, np.random.default_rng(0))
    q = codec.ids("question")
    assert seqs.shape == (16, 257) and (seqs[:, 0] == codec.bos_id).all()
    for seq, w in zip(seqs.tolist(), weights):
        at = next(i for i in range(len(q), len(seq)) if seq[i - len(q) : i] == q)  # first id after the question
        key = int("".join(str(codec.digits.index(t)) for t in seq[at + 1 : at + 6]))
        ans = codec.ids("answer", key)
        assert seq[at : at + len(ans)] == ans and seq[at + len(ans)] == codec.eos_id
        assert np.flatnonzero(w != 1).tolist() == list(range(at - 1, at - 1 + len(ans)))
        nd = codec.ids("needle", key)
        assert any(seq[i : i + len(nd)] == nd for i in range(at))
        assert c.seq_len // 4 <= at <= c.seq_len - 16
    c = train.TrainConfig(**train.TINY_TRAIN, passkey_fraction=0.0)
    plain, w = train.sample_batch(tokens, codec, c, np.random.default_rng(0))
    assert (w == 1).all() and (plain[:, 0] == codec.bos_id).all()


def test_lr_schedule():
    c = train.TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_frac=0.1)
    assert train.lr_at(0, c) == pytest.approx(0.1) and train.lr_at(9, c) == pytest.approx(1.0)
    assert train.lr_at(99, c) == pytest.approx(0.1) and train.lr_at(50, c) < train.lr_at(20, c)


def copying_model(vocab_size: int):
    """A perfect retriever at the last positions: predicts what followed the latest earlier copy of the last 3 ids."""

    def forward(ids):
        logits = torch.zeros(*ids.shape, vocab_size)
        for b, row in enumerate(ids.tolist()):
            for t in range(len(row) - 8, len(row)):
                s = next(s for s in range(t - 1, 1, -1) if row[s - 2 : s + 1] == row[t - 2 : t + 1])
                logits[b, t, row[s + 1]] = 1
        return logits

    return forward


def test_passkey_accuracy_scores_a_retriever_and_a_guesser(data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    codec = PasskeyCodec.from_json(meta["passkey"])
    val = np.fromfile(data_dir / "val.bin", np.uint16)
    args = (val, codec, train.TrainConfig(**train.TINY_TRAIN), torch.device("cpu"), contextlib.nullcontext())
    assert train.passkey_accuracy(copying_model(meta["vocab_size"]), *args)["all"] == 1.0
    uniform = train.passkey_accuracy(lambda ids: torch.zeros(*ids.shape, meta["vocab_size"]), *args)
    assert uniform == {"64": 0.0, "128": 0.0, "192": 0.0, "240": 0.0, "all": 0.0}
