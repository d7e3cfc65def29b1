import json

import pytest
import torch

from turboquant_vllm.cli import main


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


def test_verify_text(capsys):
    assert main(["verify", "--vectors", "2000", "--head-dim", "64"]) == 0
    assert "verify: ok" in capsys.readouterr().out


def test_demo_runs_the_kernels(capsys):
    assert main(["demo", "--context", "70", "--preset", "tq3"]) == 0
    out = capsys.readouterr().out
    assert "4.92x compression" in out and "relative error" in out


def test_calibrate_rejects_unknown_preset_and_needs_text(capsys):
    with pytest.raises(ValueError, match="tq4"):
        main(["calibrate", "some/model", "--text", "a.txt", "--out", "k.safetensors", "--preset", "tq9"])
    with pytest.raises(SystemExit):
        main(["calibrate", "some/model", "--out", "k.safetensors"])
    assert "--text" in capsys.readouterr().err


def test_serve_rejects_unknown_preset():
    with pytest.raises(ValueError, match="tq4"):
        main(["serve", "some/model", "--preset", "tq9"])


def test_bench_rejects_unknown_preset():
    with pytest.raises(ValueError, match="tq4"):
        main(["bench", "--presets", "tq4,tq9"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for machines without a GPU")
def test_bench_without_a_gpu_says_so(capsys):
    assert main(["bench"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "turboquant-vllm demo" in err


def test_serve_takes_the_preset_from_the_environment(monkeypatch):
    monkeypatch.setenv("TURBOQUANT_PRESET", "tq9")  # as the container image and its Quadlet unit set it
    with pytest.raises(ValueError, match="tq4"):
        main(["serve", "some/model"])


@pytest.mark.parametrize("args", [["--shapes", "64x"], ["--shapes", "64x8192,0x10"], ["--heads", "32"]])
def test_bench_rejects_malformed_shapes_and_heads(args, capsys):
    with pytest.raises(SystemExit):
        main(["bench", *args])
    assert "expected" in capsys.readouterr().err
