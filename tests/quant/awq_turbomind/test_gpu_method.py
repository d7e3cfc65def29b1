"""The vLLM method `awq_turbomind` on the GPU with the real turbomind 0.0.2 kernels: a layer created, loaded,
repacked and applied as vLLM does it, against the fp32 product x @ dequantize(W) of the checkpoint's tensors over 7-8B
and 32B layer shapes, and the op captured in a CUDA graph. Skipped without CUDA or without the turbomind wheel
(pip install ".[turbomind]" from this source tree)."""

import pytest
import torch

from turboquant_vllm.quant.awq_turbomind import awq_format, method

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GROUP = 128
SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (5120, 27648)]  # (K, N): in_features, out_features
TOKENS = [1, 7, 64, 1024]


@pytest.fixture(scope="module")
def turbomind():
    return pytest.importorskip("turbomind")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """vLLM's weight parameters ask for the tensor-parallel rank: a group of one process, as TP 1 has."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not model_parallel_is_initialized():
        with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cuda"))):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{tmp_path_factory.mktemp('pg')}/init")
            initialize_model_parallel(1)


def loaded_layer(k: int, n: int, gen: torch.Generator):
    """(method, layer, AWQ tensors): random weights quantized round-to-nearest, copied into the parameters vLLM's
    loaders fill, then process_weights_after_loading (the repack into TurboMind's layout)."""
    w = awq_format.quantize(torch.randn(k, n, generator=gen, device="cuda") * 0.02, GROUP)
    quant = method.AWQTurboMindLinearMethod(GROUP)
    layer = torch.nn.Module()
    with torch.device("cuda"):
        quant.create_weights(layer, k, [n], k, n, torch.float16, weight_loader=None)
    for name in ("qweight", "qzeros", "scales"):
        getattr(layer, name).data.copy_(getattr(w, name))
    quant.process_weights_after_loading(layer)
    assert not hasattr(layer, "qweight")
    return quant, layer, w


@pytest.mark.parametrize("k, n", SHAPES)
def test_turbomind_layers_match_the_fp32_reference(turbomind, one_rank, k, n):
    gen = torch.Generator(device="cuda").manual_seed(k * 7 + n)
    quant, layer, w = loaded_layer(k, n, gen)
    dense = awq_format.dequantize(w)  # fp32 (K, N)
    for dtype in (torch.float16, torch.bfloat16):
        for m in TOKENS:
            x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
            out = quant.apply(layer, x)
            assert out.dtype == dtype and out.shape == (m, n)
            want = x.float() @ dense
            err = ((out.float() - want).norm() / want.norm()).item()
            assert err < 1e-2, f"{k}x{n}, {m} tokens, {dtype}: relative error {err:.2e}"
    del layer, quant
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_graphs_captured_on_fresh_streams_replay(turbomind, one_rank, dtype):
    """As vLLM captures: one graph per batch size, each on a stream that never ran the op eagerly, all replayed after
    the last capture (TurboMind's per-stream workspace, made inside the first capture, once faulted here)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    k, n = 4096, 4096
    quant, layer, _ = loaded_layer(k, n, gen)
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype)
    graphs = []
    for m in (1, 8, 64, 512):
        static_x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
            static_out = quant.apply(layer, static_x, bias)
        graphs.append((graph, static_x, static_out))
    for _ in range(2):
        for graph, static_x, static_out in graphs:
            static_x.copy_(torch.randn(static_x.shape, generator=gen, device="cuda").to(dtype))
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(static_out, quant.apply(layer, static_x, bias))
