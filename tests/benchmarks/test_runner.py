"""The benchmarks package: one runner lists every benchmark, each imports without a GPU, none edits sys.path."""

import ast
import contextlib
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import benchmarks
from benchmarks import __main__ as runner
from benchmarks import common, engine_rows

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "benchmarks"
HELPERS = {"__init__", "__main__", "common", "engine_rows", "serving_common"}
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in HELPERS)


def test_the_package_is_this_checkouts():
    assert Path(benchmarks.__file__).resolve() == PACKAGE / "__init__.py"  # not a wheel's top-level `benchmarks`


def test_every_module_is_a_listed_benchmark():
    assert MODULES == sorted(benchmarks.BENCHMARKS)


@pytest.mark.parametrize("name", MODULES)
def test_each_benchmark_imports_without_a_gpu_and_has_main(name):
    module = importlib.import_module(f"benchmarks.{name}")
    assert callable(module.main) and module.__doc__


@pytest.mark.parametrize("name", MODULES + ["common", "engine_rows", "serving_common", "__main__"])
def test_no_sys_path_edits_nor_private_kernel_imports(name):
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
            pytest.fail(f"{name} touches sys.path (line {node.lineno})")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("turboquant_vllm"):
            private = [a.name for a in node.names if a.name.startswith("_")]
            assert not private, f"{name} imports private {private} from {node.module} (line {node.lineno})"


def test_runner_lists_every_benchmark_with_a_line_each():
    out = subprocess.run([sys.executable, "-m", "benchmarks"], cwd=ROOT, capture_output=True, text=True, check=True)
    listed = {line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ")}
    assert listed == set(MODULES)
    assert runner.usage() in out.stdout
    assert subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, capture_output=True,
                          text=True).stdout == out.stdout


def test_runner_refuses_an_unknown_name(capsys):
    assert runner.main(["no_such_benchmark"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


def test_runner_passes_the_arguments_on(monkeypatch):
    seen = []
    module = importlib.import_module("benchmarks.quality")
    monkeypatch.setattr(module, "main", seen.append)
    assert runner.main(["quality", "--report", "x.json"]) == 0
    assert seen == [["--report", "x.json"]]


def test_gpu_tags():
    assert common.gpu_tag("NVIDIA H200") == "h200"
    assert common.gpu_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert common.gpu_tag("NVIDIA A100-SXM4-80GB") == "a100"
    assert common.gpu_tag("NVIDIA GeForce RTX 4090") == "rtx4090"
    assert common.gpu_tag("") == "cpu"


def test_provenance_and_paths(tmp_path):
    meta = common.provenance(common.command_line("e2e", ["--heads", "32/8"]))
    assert meta["command"] == "python -m benchmarks e2e --heads 32/8"
    assert set(meta["versions"]) == {"torch", "triton", "vllm", "turboquant-vllm"} and meta["versions"]["torch"]
    assert meta["commit"] is None or len(meta["commit"].removesuffix("-dirty")) >= 7
    assert common.result_stem("decode_kernel", "32q8kv-64x8k", "h200") == (
        common.RESULTS / "decode_kernel" / "h200-32q8kv-64x8k")
    assert common.stem_of("x/h200-a.json") == Path("x/h200-a") and common.stem_of("x/h200-a") == Path("x/h200-a")
    common.write_json(tmp_path / "r.json", dict(meta=dict(runs="1x8"), rows=[]), meta)
    doc = __import__("json").loads((tmp_path / "r.json").read_text())
    assert doc["meta"]["runs"] == "1x8" and doc["meta"]["command"] == meta["command"]
    common.write_markdown(tmp_path / "r.md", "| a |\n", meta)
    assert (tmp_path / "r.md").read_text().endswith("| a |\n") and "python -m benchmarks e2e" in (
        tmp_path / "r.md").read_text()


def test_children_run_as_modules_from_anywhere(tmp_path):
    cmd = common.module_command("e2e", "--help")
    assert cmd[1:3] == ["-m", "benchmarks.e2e"]
    out = subprocess.run(cmd, cwd=tmp_path, env=common.child_env(), capture_output=True, text=True, check=True)
    assert "python -m benchmarks e2e" in out.stdout


# ---- engine_rows.WeightRows: the runner awq and weights share, on a kind of rows of its own -----------------------

class ToyRows(engine_rows.WeightRows):
    name, tag = "toy", "TOY_ROW"
    kernel_patterns = ((re.compile(r"kernel (\w+)"), "{0}"),)
    order_labels = ("base", "ours")
    ours, dtype, meta_extra = "ours", "float16", dict(toy=True)
    variant_column = ("variant", lambda r: r.get("variant") or "")
    versus = ("the base", "base")

    @staticmethod
    def parse_method(spec):
        method, _, variant = spec.strip().lower().partition(":")
        if not method:
            raise ValueError(f"empty method in {spec!r}")
        return method, variant or None

    def identity(self, spec):
        method, variant = self.parse_method(spec)
        return dict(method=method, variant=variant, label=spec)

    def add_arguments(self, ap):
        ap.add_argument("--methods", default="ours,base")
        engine_rows.add_row_arguments(ap, self.name)
        ap.add_argument("--model-dir", type=Path)

    def model(self, args):
        return engine_rows.llama3_8b(engine_rows.LLAMA3_8B, args.layers, args.input_len, args.output_len)

    @contextlib.contextmanager
    def model_dirs(self, args, model):
        yield lambda spec: Path("/models") / spec

    def child_arguments(self, args, model_dir):
        return ["--model-dir", str(model_dir)]

    def child_model_dir(self, args):
        return args.model_dir

    def prepare_child(self, method, variant, config):
        self.prepared = (method, variant, config["vocab_size"])

    def child_facts(self, method):
        return {"kernel": "plain"} if method == "base" else {}

    def add_ratios(self, rows):
        ref = next((r for r in rows if r["label"] == "base" and engine_rows.row_ok(r)), None)
        engine_rows.add_row_ratios(rows, ref, ref, "base")
        return " Ratios: against the base row."

    def intro(self, rows, model):
        return "Toy rows."

    def plot_title(self, model):
        return "Toy rows"

    def summary_path(self, args, stem):
        return common.with_ext(stem, "-summary.json")

    def write_summary(self, path, rows):
        path.write_text(json.dumps([r["label"] for r in rows]))


def test_rows_methods_arguments_and_child_command(capsys):
    toy = ToyRows()
    with pytest.raises(SystemExit):
        toy.arguments(["--help"])
    out = capsys.readouterr().out  # named as run, its module's docstring as the description
    assert out.startswith("usage: python -m benchmarks toy") and __doc__ in out
    assert toy.methods(" Ours, base:X ,ours,base:x") == ["ours", "base:x"]  # canonical, each once
    with pytest.raises(ValueError, match="names no method"):
        toy.methods(" , ")
    with pytest.raises(SystemExit):
        toy.arguments(["--methods", ","])
    args = toy.arguments(["--layers", "2", "--prompts", "7", "--timeout", "9", "--merge", "--out", "x"])
    cmd = toy.child_command("base:x", "/m", args)
    assert cmd[1:3] == ["-m", "benchmarks.toy"] and cmd[-4:] == ["--model-dir", "/m", "--child", "base:x"]
    child = toy.arguments(cmd[3:])  # the child reads back what the parent measures, not its own options
    assert (child.child, child.model_dir, child.layers, child.prompts) == ("base:x", Path("/m"), 2, 7)
    assert child.timeout == 0 and not child.merge and child.out is None
    assert toy.result_paths(args)[0] == Path("x") and toy.settings(args)["prompts"] == 7


def test_rows_engine_builds_the_row_in_the_child(tmp_path, monkeypatch):
    import vllm

    built = []
    monkeypatch.setattr(vllm, "LLM", lambda **kw: built.append(kw) or "llm")
    monkeypatch.setattr(engine_rows, "engine_facts", lambda llm: dict(kv_cache_tokens=5))
    monkeypatch.setattr(engine_rows, "time_requests", lambda llm, vocab, *rest: dict(vocab=vocab, rest=list(rest)))
    (tmp_path / "config.json").write_text(json.dumps(dict(vocab_size=99)))
    toy = ToyRows()
    row = toy.engine("base:x", str(tmp_path), 10, 64, 8, 0.8, 3)
    assert list(row) == ["method", "variant", "label", "kv_cache_tokens", "kernel", "vocab", "rest"]
    assert (row["label"], row["kernel"], row["vocab"], row["rest"]) == ("base:x", "plain", 99, [10, 64, 8, 3])
    assert toy.prepared == ("base", "x", 99)
    assert built == [dict(model=str(tmp_path), dtype="float16", skip_tokenizer_init=True, seed=0, max_model_len=80,
                          gpu_memory_utilization=0.8, enable_prefix_caching=False)]
    toy.engine("base:x", str(tmp_path), 10, 64, 8, 0.8, 3, tp=2)  # each engine over two GPUs
    assert built[-1]["tensor_parallel_size"] == 2


def test_rows_tensor_parallel_reaches_the_child_the_names_and_the_text():
    toy = ToyRows()
    args = toy.arguments(["--layers", "2", "--prompts", "7", "--tp", "2"])
    child = toy.arguments(toy.child_command("base:x", "/m", args)[3:])
    assert child.tp == 2 and toy.arguments(toy.child_command("base:x", "/m", toy.arguments([]))[3:]).tp == 1
    assert engine_rows.rows_config_name(args).endswith("-2l-7x1024-128-tp2")
    assert not engine_rows.is_default_rows(toy.arguments(["--tp", "2"]))
    settings = toy.settings(args)
    assert settings["tensor_parallel_size"] == 2 and "tensor_parallel_size" not in toy.settings(toy.arguments([]))
    assert engine_rows.timing_text(settings).endswith("Tensor parallel 2: each engine over that many GPUs.")
    with pytest.raises(SystemExit):
        toy.arguments(["--tp", "0"])


def test_rows_measure_reads_the_child_and_its_log(tmp_path):
    script = tmp_path / "child.py"
    script.write_text("import sys\nsys.stderr.write('kernel Fast\\nModel loading took 2.5 GiB\\n')\n"
                      "print('TOY_ROW ' + '{\"label\": \"ours\", \"output_tok_s\": 3.0}')\n")
    got = ToyRows().measure("ours", [sys.executable, str(script)], tmp_path / "ours.log", None, "cmd")
    assert (got["output_tok_s"], got["kernel"], got["weights_gib"], got["command"]) == (3.0, "Fast", 2.5, "cmd")
    script.write_text("raise SystemExit(3)\n")
    got = ToyRows().measure("base:x", [sys.executable, str(script)], tmp_path / "b.log", None, "cmd")
    assert (got["method"], got["variant"], got["error"]) == ("base", "x", "exit status 3")


def test_rows_main_writes_results_and_summary_after_every_row(tmp_path, monkeypatch):
    toy, out, seen = ToyRows(), tmp_path / "r", []

    def fake_measure(spec, cmd, log, timeout, command):
        seen.append((spec, cmd[cmd.index("--model-dir") + 1], log.name))
        assert with_summary.exists() == (len(seen) > 1)  # written after every row
        return dict(toy.identity(spec), kernel="k", output_tok_s=10.0 * len(seen), decode_latency_ms=1.0,
                    command=command)

    with_summary = tmp_path / "r-summary.json"
    monkeypatch.setattr(toy, "measure", fake_measure)
    toy.main(["--layers", "2", "--out", str(out)])
    assert seen == [("ours", "/models/ours", "ours.log"), ("base", "/models/base", "base.log")]
    data = json.loads(out.with_suffix(".json").read_text())
    assert [r["label"] for r in data["rows"]] == ["base", "ours"] and json.loads(with_summary.read_text()) == [
        "base", "ours"]  # in order_labels' order
    assert data["meta"]["toy"] and data["meta"]["model"]["num_hidden_layers"] == 2 and data["meta"]["prompts"] == 1000
    assert data["rows"][1]["output_tok_s_vs_base"] == pytest.approx(0.5)
    md = out.with_suffix(".md").read_text()
    assert ("\n\nToy rows.\n\n| method | variant | kernel | output tok/s | vs the base | run s = prefill + decode | "
            "batch-1 decode ms/token | decode speed vs the base | CUDA graphs | KV cache tokens | weights GiB |") in md
    assert "| ours |  | k | 10 | 0.50x |  | 1.00 | 1.00x |" in md
    assert "median of 3. Ratios: against the base row.\n\nMeasured by:\n- base, ours: `python -m benchmarks toy" in md
    assert out.with_suffix(".png").stat().st_size > 0


def test_a_row_takes_the_median_of_its_runs_and_splits_it_at_the_prefill(monkeypatch):
    """time_requests on a stand-in engine whose clock moves 1 ms a generated token and 0.1 s a call (3 ms on the
    second run): warm-up, the throughput runs, the prefill-only runs, then the batch-1 pairs, in that order."""
    calls, clock = [], [0.0]

    class Engine:
        def generate(self, batch, params, use_tqdm):
            calls.append((len(batch), params.max_tokens))
            clock[0] += 0.1 + 0.001 * len(batch) * params.max_tokens + (0.003 if len(calls) == 4 else 0)
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7] * params.max_tokens)]) for _ in batch]

    monkeypatch.setattr(engine_rows.time, "perf_counter", lambda: clock[0])
    row = engine_rows.time_requests(Engine(), 100, prompts=8, input_len=5, output_len=4)
    runs = engine_rows.THROUGHPUT_REPEATS
    assert calls == ([(engine_rows.WARMUP_PROMPTS, 4), (1, 4)] + [(8, 4)] * runs + [(8, 1)] * runs
                     + [(1, 1), (1, 4)] * engine_rows.LATENCY_REPEATS)
    assert row["runs_s"] == pytest.approx([0.132, 0.135, 0.132]) and row["seconds"] == pytest.approx(0.132)
    assert row["prefill_s"] == pytest.approx(0.108) and row["output_tok_s"] == pytest.approx(32 / 0.132)
    assert engine_rows.run_split_cell(row) == "0.132 = 0.108 + 0.024"
    assert engine_rows.run_split_cell({"seconds": 1.0}) == ""  # a row measured before the split
