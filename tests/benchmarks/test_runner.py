"""The benchmarks package: one runner lists every benchmark, each imports without a GPU, none edits sys.path."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks
from benchmarks import __main__ as runner
from benchmarks import common

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "benchmarks"
HELPERS = {"__init__", "__main__", "common"}
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in HELPERS)


def test_the_package_is_this_checkouts():
    assert Path(benchmarks.__file__).resolve() == PACKAGE / "__init__.py"  # not a wheel's top-level `benchmarks`


def test_every_module_is_a_listed_benchmark():
    assert MODULES == sorted(benchmarks.BENCHMARKS)


@pytest.mark.parametrize("name", MODULES)
def test_each_benchmark_imports_without_a_gpu_and_has_main(name):
    module = importlib.import_module(f"benchmarks.{name}")
    assert callable(module.main) and module.__doc__


@pytest.mark.parametrize("name", MODULES + ["common", "__main__"])
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
    module = importlib.import_module("benchmarks.quality_transform_bound")
    monkeypatch.setattr(module, "main", seen.append)
    assert runner.main(["quality_transform_bound", "--windows", "1"]) == 0
    assert seen == [["--windows", "1"]]


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
