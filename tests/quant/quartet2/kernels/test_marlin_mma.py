"""The few-token native GEMM's arithmetic (quant.quartet2.kernels.marlin_mma) on the CPU: its PyTorch emulation
(naive.py) decodes Marlin's words with the kernel's own bit operations into exactly the NVFP4 weight the dense decoder
reads, and sums them into the W4A16 product; the split policy covers every k-tile; the build step and its errors. On
the GPU, the kernel against the emulation: test_gpu_marlin_mma.py."""

import pytest
import torch

from tests.conftest import DEVICE
from tests.quant.quartet2.kernels.test_marlin_dequant import weight
from turboquant_vllm.quant.quartet2 import nvfp4
from turboquant_vllm.quant.quartet2.kernels import marlin, marlin_layout, marlin_mma
from turboquant_vllm.quant.quartet2.kernels.marlin.naive import w4a16_reference
from turboquant_vllm.quant.quartet2.kernels.marlin_dequant.naive import dequantize_reference
from turboquant_vllm.quant.quartet2.kernels.marlin_mma import naive, native
from turboquant_vllm.quant.quartet2.kernels.marlin_mma.__main__ import main


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_every_word_decodes_to_its_e2m1_values(dtype):
    """Random words: a word's 8 codes come out as the E2M1 values times 2^-126 (bf16: 0.5 on a subnormal) or 2^-14
    (fp16), in the fragment's order (register r <- nibbles (j, j + 4), j = 0, 2, 1, 3), exactly."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randint(0, 2**32, (4096,), generator=gen, dtype=torch.int64)
    got = naive.halves(naive.decode_words(w, dtype), dtype)  # (words, r, h)
    nib = torch.stack([(w >> (4 * j)) & 15 for j in range(8)], dim=-1)
    order = torch.tensor([[0, 4], [2, 6], [1, 5], [3, 7]])
    want = nvfp4.e2m1_value(nib[:, order]) * 2.0 ** (-126 if dtype == torch.bfloat16 else -14)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_scale_bytes_decode_to_their_values(dtype):
    """Every byte Marlin writes for a kept group (E5M3 of a normal fp16, 1 <= E5 <= 30), duplicated in both lanes:
    fp16(byte << 7) (= scale x factor x 2^7), for bf16 times 2^111 more. fp16 activations leave the scales unlifted:
    E5 >= 13 (the smallest E4M3 normal times 2^7)."""
    b = torch.arange(8 if dtype == torch.bfloat16 else 0x40, 0xF8, dtype=torch.int64)
    lanes = naive.halves(naive.scale_dup(b | (b << 16), dtype), dtype)
    value = (b << 7).to(torch.int16).view(torch.float16).float() * (2.0**111 if dtype == torch.bfloat16 else 1)
    assert torch.equal(lanes[:, 0], value) and torch.equal(lanes[:, 1], value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["quantized", "small scales", "tiny groups"])
@pytest.mark.parametrize("shape", [(192, 256), (100, 208)], ids=["192x256", "100x208-padded"])
def test_the_fragments_hold_the_dense_decoders_weight(marlin_layout_on_cpu, dtype, case, shape):
    n, k = shape
    m = marlin.prepare(weight(n, k, n + k + 1, case), dtype)
    marlin_mma.zero_flushed_codes(m.weight, m.weight_scale)  # as prepare does where the kernel is built
    t = marlin_layout.tables(m.weight.device, dtype)
    want = dequantize_reference(m.weight, m.weight_scale, t, n, k)
    want *= 2.0**-naive.FRAGMENT_SHIFT[dtype]
    assert torch.equal(naive.decoded_weight(m.weight.cpu(), m.weight_scale.cpu(), n, k, dtype), want.cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("splits", [1, 3])
def test_the_emulation_is_w4a16(marlin_layout_on_cpu, dtype, tokens, splits):
    n, k = 136, 496  # 31 k-tiles: uneven splits and warps; N padded to 192
    w = weight(n, k, tokens * 10 + splits)
    m = marlin.prepare(w, dtype)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    per = -(-(k // 16) // splits)
    y = naive.emulate(x, m.weight.cpu(), m.weight_scale.cpu(), n, k, m.dense_alpha, splits, per)
    assert y.shape == (tokens, n) and y.dtype == dtype and not y.isnan().any()
    u = torch.finfo(dtype).eps / 2
    ref = w4a16_reference(x, w)
    assert ((y.double() - ref).abs() <= u * ref.abs() + 1e-6 * ref.abs().max()).all()


@pytest.mark.parametrize("padded_n,k", [(64, 16), (3584, 3584), (5376, 3584), (14336, 3584), (3584, 14336),
                                        (128, 65536)])
@pytest.mark.parametrize("sms", [1, 132])
def test_the_split_plan_covers_every_k_tile(padded_n, k, sms):
    splits, per = marlin_mma.split_plan(padded_n, k, sms)
    k_tiles = k // 16
    assert splits >= 1 and (splits - 1) * per < k_tiles <= splits * per  # none empty, none missing
    assert splits == 1 or per >= 2 * naive.WARPS


def test_without_the_library_the_path_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setenv(native.DIR_ENV, str(tmp_path))
    native.load.cache_clear()
    try:
        assert native.load() is None
        assert native.library_path().parent == tmp_path
        if DEVICE == "cuda" and torch.cuda.get_device_capability() >= (8, 0):
            assert "marlin_mma build" in marlin_mma.supported(torch.device("cuda"))
        assert marlin_mma.supported(torch.device("cpu")) == "not for a cpu device"
    finally:
        native.load.cache_clear()


def test_the_build_command_targets_ampere_and_hopper(tmp_path):
    cmd = native.nvcc_command(tmp_path / "x.so", "/opt/cuda/bin/nvcc")
    assert cmd[0] == "/opt/cuda/bin/nvcc" and str(native.SOURCE) in cmd
    assert "-gencode=arch=compute_80,code=sm_80" in cmd and "-gencode=arch=compute_90,code=sm_90" in cmd


def test_flushed_groups_lose_their_codes_only(marlin_layout_on_cpu):
    """The codes of groups Marlin flushes (zero scale bytes) are zeroed, and no other."""
    n, k = 192, 256
    w = weight(n, k, 7, "tiny groups")
    m = marlin.prepare(w, torch.bfloat16)
    marlin_mma.zero_flushed_codes(m.weight, m.weight_scale)  # what prepare does where the kernel is built
    t = marlin_layout.tables(m.weight.device, torch.bfloat16)
    kk, nn = torch.meshgrid(torch.arange(k), torch.arange(n), indexing="xy")
    word = t.word.long().cpu()[kk % 16, nn % 64] + kk // 16 * 2 * m.weight_scale.shape[1] + nn // 64 * 128
    code = (m.weight.cpu().reshape(-1).long()[word.reshape(-1)].reshape(n, k) >> t.shift.long().cpu()[kk % 16, nn % 64]
            ) & 15
    flushed = marlin.marlin_flushed_groups(w.scales, torch.bfloat16).cpu().repeat_interleave(nvfp4.GROUP, dim=1)
    packed = w.packed.cpu().view(torch.uint8).long()
    original = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(n, k)  # element 2 i in the low nibble
    assert flushed.any() and not code[flushed].any()
    assert torch.equal(code[~flushed], original[~flushed])


def test_a_missing_or_failing_nvcc_is_named(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(native.DIR_ENV, str(tmp_path))
    assert main(["build", str(tmp_path / "no-nvcc")]) == 1
    assert "no nvcc at" in capsys.readouterr().err
    failing = tmp_path / "nvcc"
    failing.write_text("#!/bin/sh\nexit 3\n")
    failing.chmod(0o755)
    assert main(["build", str(failing)]) == 1
    assert "nvcc failed (exit status 3" in capsys.readouterr().err
    assert not native.library_path().exists()
    assert main([]) == 2
