"""benchmarks.quality on the CPU: its pure pieces and the report, no vLLM engine."""

from __future__ import annotations

import json
import math
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks import quality


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
    digits, answer = list(range(10, 20)), [5, 11, 12]
    assert quality.answer_matches([5, 11, 12], answer, digits)
    assert quality.answer_matches([5, 11, 12, 3], answer, digits)
    assert not quality.answer_matches([5, 11, 12, 13], answer, digits)  # a longer number
    assert not quality.answer_matches([5, 11, 13, 3], answer, digits)
    assert not quality.answer_matches([11, 12, 3], answer, digits)


def test_needle_grid_rows_are_depths():
    cells = [dict(length=n, depth=d) for n in (1024, 2048) for d in (0, 50, 100) for _ in range(4)]
    hits = [c["depth"] == 0 or (c["length"] == 1024 and i % 2 == 0) for i, c in enumerate(cells)]
    grid = quality.needle_grid(cells, hits)
    assert grid == dict(lengths=[1024, 2048], depths=[0, 50, 100], per_cell=4,
                        accuracy=[[1.0, 1.0], [0.5, 0.0], [0.5, 0.0]])


class CharTokenizer:
    """One id per character: digits are single tokens, as the reference tokenizer's are."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_needle_prompts_place_the_key():
    passkey = pytest.importorskip("reference_lm.passkey", reason="reference_lm/passkey.py is not there yet")
    codec = passkey.PasskeyCodec.from_tokenizer(CharTokenizer(), bos_id=1, eos_id=2)
    hay = CharTokenizer().encode("Filler sentences about startups. " * 300)
    lengths, depths = [300, 600], [0, 25, 50, 75, 100]
    cells = quality.needle_prompts(codec, hay, lengths, depths, n=10)
    assert [(c["length"], c["depth"]) for c in cells[::10]] == [(n, d) for n in lengths for d in depths]
    question = codec.ids("question")
    for c in cells:
        ids, needle = c["ids"], codec.ids("needle", c["key"])
        assert len(ids) == c["length"] and ids[0] == 1 and ids[-len(question):] == question
        assert ids[c["at"]: c["at"] + len(needle)] == needle
        fill = c["length"] - 1 - len(needle) - len(question)
        assert abs(c["at"] - 1 - c["depth"] / 100 * fill) <= 1  # after the BOS, at its depth into the filler
        assert c["answer"] == codec.ids("answer", c["key"]) and 10000 <= c["key"] < 100000
    for i in range(0, len(cells), 10):
        assert len({c["key"] for c in cells[i:i + 10]}) == 10
    assert quality.needle_prompts(codec, hay, lengths, depths, n=10) == cells  # seeded


def test_bytes_per_token():
    assert {kv: quality.bytes_formula(kv, 16, 128) for kv in ("bf16", "fp8", "tq4", "tq3", "k4v3", "k3v2", "tq2")} == {
        "bf16": 512, "fp8": 256, "tq4": 136, "tq3": 104, "k4v3": 120, "k3v2": 88, "tq2": 72}
    assert quality.bytes_formula("tq3-cal", 16, 128) == 104  # a key calibration costs no bytes per token


def test_bytes_per_token_of_vllm_turboquant():
    """vLLM 0.25's slots (K: codes + fp16 norm or fp8; V: codes + fp16 scale and zero), layers 0, 1, 14, 15 in bf16."""
    pytest.importorskip("vllm")
    got = {kv: quality.bytes_formula(kv, 16, 128) for kv in quality.KV if kv.startswith("turboquant_")}
    slots = {"turboquant_k8v4": 196, "turboquant_4bit_nc": 134, "turboquant_k3v4_nc": 118, "turboquant_3bit_nc": 102}
    assert got == {kv: (4 * 512 + 12 * s) / 16 for kv, s in slots.items()}
    assert 512 / got["turboquant_4bit_nc"] == pytest.approx(2.24, abs=0.01)  # the kit's measured 2.24x KV tokens


def test_pareto_front():
    pts = [(512, 0.0), (256, 0.1), (136, 0.5), (136, 0.7), (104, 2.0), (200, 1.0), (256, 0.1)]
    assert [pts[i] for i in quality.pareto(pts)] == [(104, 2.0), (136, 0.5), (256, 0.1), (256, 0.1), (512, 0.0)]


def test_prepare_tokenizes_windows_and_kl_prompts(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = [f"w{i % 97}x{i % 13}" for i in range(5000)]
    tok.train_from_iterator([" ".join(words)], trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    model = tmp_path / "model"
    model.mkdir()
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))
    (model / "config.json").write_text(json.dumps(dict(
        max_position_embeddings=64, num_hidden_layers=2, hidden_size=1024, num_attention_heads=8, head_dim=128)))
    (tmp_path / "wiki.txt").write_text(" ".join(words))
    held = np.arange(3, 2003, dtype=np.uint16)
    held.tofile(tmp_path / "val.bin")
    args = quality.parser().parse_args([
        "--model", str(model), "--wikitext", str(tmp_path / "wiki.txt"), "--heldout", str(tmp_path / "val.bin"),
        "--heldout-windows", "3", "--kl-prompts", "5", "--kl-prompt-len", "20,30", "--kl-tokens", "16"])
    inp = quality.prepare(args)
    assert (inp["prefix"], inp["scored_from"], inp["context"], inp["head_dim"]) == ([0], 1, 64, 128)
    assert inp["heldout"] == [[0] + held[i * 63:(i + 1) * 63].tolist() for i in range(3)]
    text_ids = tok.encode(" ".join(words), add_special_tokens=False).ids
    assert [t for w in inp["wikitext2"] for t in w[1:]] == text_ids[: len(inp["wikitext2"]) * 63]
    for p in inp["kl_prompts"]:  # BOS + a stretch of the held-out ids (consecutive values here)
        assert 20 <= len(p) <= 30 and p[0] == 0 and p[1:] == list(range(p[1], p[1] + len(p) - 1))
    assert inp["needles"] == []


def results_doc() -> dict:
    grid = dict(lengths=[1024, 2048, 3072, 4000], depths=[0, 25, 50, 75, 100], per_cell=10,
                accuracy=[[1.0, 1.0, 0.9, 0.8]] * 5)

    def row(kv, b, ppl, kl, needle=1.0):
        return dict(kv=kv, bytes_per_token=b, ppl_wikitext2=ppl, ppl_heldout=ppl / 2, needle_accuracy=needle,
                    needle_grid=grid, kl_vs_bf16=kl, kl_stderr=kl / 10, kv_tokens=1000, seconds=60.0)

    rows = [row("bf16", 512, 20.0, 0.0), row("fp8", 256, 20.1, 0.001), row("turboquant_4bit_nc", 228.5, 20.6, 0.02),
            row("tq4", 136, 20.4, 0.01), row("tq3", 104, 21.0, 0.05, 0.9),
            dict(kv="turboquant_3bit_nc", bytes_per_token=204.5, seconds=12.0, error="Traceback\nRuntimeError: boom")]
    return dict(model="ref-llama", rows=rows, vllm="0.25.0", device="H200",
                settings=dict(context=4096, bos=True, wikitext2_windows=83, heldout_windows=32))


def test_markdown_table():
    md = quality.markdown(results_doc())
    assert "| tq4 | 136.0 | 20.400 (+2.00%) | 10.200 (+2.00%) | 1.000 | 0.01 ± 0.001 | 1,000 | 60 |" in md
    assert "| turboquant_3bit_nc (failed) | 204.5 |" in md and "turboquant_3bit_nc failed: `RuntimeError: boom`" in md
    assert "+2.71%" in md and "0.997" in md
    assert "Measured by" not in md  # one call measured every row
    doc = results_doc()
    doc["rows"][2]["command"] = "an earlier call"  # merged (--merge) from another run
    assert "- Measured by `an earlier call`: turboquant_4bit_nc." in quality.markdown(doc)
    assert "- Measured by `unrecorded`: bf16, fp8, tq4, tq3, turboquant_3bit_nc." in quality.markdown(doc)


def test_report_writes_markdown_and_figures(tmp_path):
    pytest.importorskip("matplotlib", reason="the figures need matplotlib")
    src = tmp_path / "quality.json"
    src.write_text(json.dumps(results_doc()))
    quality.main(["--report", str(src), "--results-dir", str(tmp_path / "out")])
    assert (tmp_path / "out" / "quality.md").read_text() == quality.markdown(results_doc())
    heatmaps = [f"quality/needle/{r['kv']}.png" for r in results_doc()["rows"] if r.get("needle_grid")]
    assert len(heatmaps) == 5 and sorted(p.name for p in (tmp_path / "out" / "quality" / "needle").iterdir()) == sorted(
        h.split("/")[-1] for h in heatmaps)  # one per KV cache with a grid (the failed one has none)
    for name in ("quality.png", "quality/needle.png", *heatmaps):
        assert (tmp_path / "out" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# Stands in for `quality.py --child KV`: appends its events to a file *before* the parent can see them happen (its
# first row, its exit), so the file's order is an order the parent's scheduling must respect.
FAKE_CHILD = r"""
import json, os, sys, time
kv, events = sys.argv[1], sys.argv[2]

def event(what):
    fd = os.open(events, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, f"{what} {kv}\n".encode())
    os.close(fd)

row = dict(kv=kv, gpu_memory_utilization=os.environ.get("QUALITY_GPU_MEMORY_UTILIZATION"))
event("start")
time.sleep(0.1)  # the engine's startup: short, so only --parallel keeps more from running
if kv == "k5v4":
    event("end")
    sys.exit("RuntimeError: no engine")
event("up")
print("QUALITY_ROW " + json.dumps(row), flush=True)
time.sleep(0.8)  # the metrics
row["ppl_wikitext2"] = 20.0
print("QUALITY_ROW " + json.dumps(row), flush=True)
event("end")
if kv == "tq2":
    sys.exit("RuntimeError: boom")
"""


def test_parallel_run_schedules_children(tmp_path, monkeypatch, capsys):
    events = tmp_path / "events"
    monkeypatch.setattr(quality, "child_command", lambda kv, work: [sys.executable, "-c", FAKE_CHILD, kv, str(events)])
    monkeypatch.setattr(quality, "prepare", lambda args: {
        "context": 64, "prefix": [0], "num_layers": 2, "head_dim": 128, "wikitext2": [], "heldout": [], "kl_prompts": []})
    monkeypatch.setattr(quality, "metadata", SimpleNamespace(version=lambda name: "test"))
    chosen, parallel = ["tq2", "k5v4", "tq3", "fp8", "bf16", "k3v2", "tq4", "k4v3"], 3
    out = tmp_path / "quality.json"
    quality.run(quality.parser().parse_args([
        "--model", str(tmp_path / "ref-llama"), "--kv", ",".join(chosen), "--out", str(out),
        "--work", str(tmp_path / "work"), "--parallel", str(parallel)]))

    running, up, widest = set(), set(), 0
    lines = [line.split() for line in events.read_text().splitlines()]
    assert lines[:3] == [["start", "bf16"], ["up", "bf16"], ["end", "bf16"]]  # bf16 first and alone
    for what, kv in lines:
        if what == "start":
            assert running <= up, f"{kv} started beside {running - up} still starting"
            running.add(kv)
            widest = max(widest, len(running))
        elif what == "up":
            up.add(kv)
        else:
            running.remove(kv)
    assert widest == parallel and not running and sorted(kv for what, kv in lines if what == "start") == sorted(chosen)

    doc = json.loads(out.read_text())
    rows = {r["kv"]: r for r in doc["rows"]}
    assert list(rows) == [kv for kv in quality.KV if kv in chosen]
    assert "boom" in rows["tq2"]["error"] and rows["tq2"]["ppl_wikitext2"] == 20.0  # failed after its last row
    assert rows["k5v4"] == {"kv": "k5v4", "error": "RuntimeError: no engine", "seconds": rows["k5v4"]["seconds"],
                            "bytes_per_token_formula": 152, "bytes_per_token": 152,
                            "command": rows["k5v4"]["command"]}  # no row: the formula's bytes
    assert all(r["command"].startswith("python -m benchmarks quality") for r in rows.values())
    assert doc["meta"]["command"] == rows["bf16"]["command"] and "commit" in doc["meta"]  # the call's provenance
    assert all("error" not in r and r["ppl_wikitext2"] == 20.0 for kv, r in rows.items() if kv not in ("tq2", "k5v4"))
    share = 0.85 / parallel  # below the default 0.5
    assert rows["bf16"]["gpu_memory_utilization"] is None  # bf16 alone keeps inputs.json's share
    assert all(float(r["gpu_memory_utilization"]) == pytest.approx(share) for kv, r in rows.items()
               if kv not in ("bf16", "k5v4"))
    assert doc["settings"]["parallel"] == parallel
    assert doc["settings"]["parallel_gpu_memory_utilization"] == pytest.approx(share)
    log = quality.children_log(out, None).read_text()
    assert quality.children_log(out, None) == tmp_path / "quality" / "cpu-children.log"
    assert all(f"==== {kv} (rc {1 if kv in ('tq2', 'k5v4') else 0})" in log for kv in chosen)
    printed = capsys.readouterr().out
    assert printed.endswith(quality.markdown(doc) + "\n") and "ran 3 at once" in printed


def test_child_timeout_kills_it_and_keeps_its_rows(tmp_path, monkeypatch):
    script = "import time; print('QUALITY_ROW {\"kv\": \"tq4\"}', flush=True); time.sleep(60)"
    monkeypatch.setattr(quality, "child_command", lambda kv, work: [sys.executable, "-c", script])
    stdout, stderr, rc, seconds = quality.child("tq4", tmp_path, {}, 1.0, quality.threading.Lock())
    assert stdout == 'QUALITY_ROW {"kv": "tq4"}\n' and rc == -9 and 1 <= seconds < 5
    assert stderr.endswith("TimeoutError: killed after 1 s")
