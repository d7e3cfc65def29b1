"""quartet2's execution path (quant.quartet2.plugin.paths) on the CPU: chosen from $TURBOQUANT_QUARTET2_PATH and the
GPU (its probe replaced), logged with the reason, or refused with the way out."""

import pytest
import torch

from turboquant_vllm.quant.quartet2.plugin import method, paths
from turboquant_vllm.quant.quartet2.plugin.config import Quartet2Config


def test_the_path_is_chosen_or_refused_with_the_way_out(monkeypatch, caplog):
    monkeypatch.delenv(paths.PATH_ENV, raising=False)
    # (capability, Marlin FP4 runs, vLLM's CUTLASS NVFP4 GEMM runs) -> auto's path and its reason
    for gpu, path, why in (((80, True, False), "marlin", "no FP4 tensor cores"),
                           ((90, True, False), "marlin", "no FP4 tensor cores"),
                           ((100, True, False), "marlin", "no CUTLASS NVFP4 GEMM"),
                           ((100, True, True), "w4a4", "FP4 tensor cores through vLLM's CUTLASS NVFP4 GEMM"),
                           ((120, False, True), "w4a4", "FP4 tensor cores through vLLM's CUTLASS NVFP4 GEMM")):
        monkeypatch.setattr(paths, "gpu", lambda g=gpu: g)
        chosen, reason = paths.choose_path()
        assert chosen == path and reason.startswith(f"auto on sm{gpu[0]}") and why in reason, reason
    monkeypatch.setattr(paths, "gpu", lambda: (100, True, False))
    with caplog.at_level("INFO", logger=method.logger.name):
        assert Quartet2Config().path == "marlin"
    assert "NVFP4 path marlin (auto on sm100" in caplog.text
    monkeypatch.setenv(paths.PATH_ENV, "marlin")
    assert paths.choose_path()[0] == "marlin"
    monkeypatch.setattr(paths, "gpu", lambda: (100, True, True))
    assert paths.choose_path()[0] == "marlin"  # asked for, on Blackwell too
    monkeypatch.setenv(paths.PATH_ENV, "w4a4")
    caplog.clear()
    with caplog.at_level("INFO", logger=method.logger.name):
        assert Quartet2Config().path == "w4a4"
    assert "NVFP4 path w4a4 (w4a4 on sm100: NVFP4 weights and activations (per row)" in caplog.text
    # w4a4 asked for where it cannot run: refused with the reason and the other paths
    for gpu, lack in (((90, True, False), "sm90: no FP4 tensor cores"),
                      ((100, True, False), "sm100: this vLLM build has no CUTLASS NVFP4 GEMM"),
                      ((None, False, False), "no CUDA GPU: no FP4 tensor cores")):
        monkeypatch.setattr(paths, "gpu", lambda g=gpu: g)
        with pytest.raises(ValueError, match=f"{paths.PATH_ENV}=w4a4 cannot run here \\({lack}.*auto.*marlin.*"
                                             f"emulate"):
            Quartet2Config()
    # no Marlin FP4 here (no CUDA GPU, or vLLM without its kernels): auto and marlin refuse, naming the emulation
    monkeypatch.setattr(paths, "gpu", lambda: (None, False, False))
    for requested in ("auto", "marlin"):
        monkeypatch.setenv(paths.PATH_ENV, requested)
        with pytest.raises(ValueError, match=f"no CUDA GPU.*{paths.PATH_ENV}=emulate"):
            Quartet2Config()
    monkeypatch.setenv(paths.PATH_ENV, "fast")
    with pytest.raises(ValueError, match="choose one of auto, w4a4, marlin, emulate"):
        paths.choose_path()
    monkeypatch.setenv(paths.PATH_ENV, "emulate")
    assert Quartet2Config().path == "emulate"


def test_without_a_cuda_gpu_auto_refuses(monkeypatch):
    """The real device probe (vLLM's platform and is_fp4_marlin_supported)."""
    monkeypatch.delenv(paths.PATH_ENV, raising=False)
    capability, marlin_ok, w4a4_ok = paths.gpu()
    if torch.cuda.is_available():
        assert capability == torch.cuda.get_device_capability()[0] * 10 + torch.cuda.get_device_capability()[1]
        assert marlin_ok == (capability >= 75) and w4a4_ok == (capability >= 100)
    else:
        assert (capability, marlin_ok, w4a4_ok) == (None, False, False)
        with pytest.raises(ValueError, match=f"{paths.PATH_ENV}=emulate"):
            Quartet2Config()
