"""CloverLM as a vLLM model (models.cloverlm.vllm_model) on the CPU: registration, the model built by vLLM's layers
from a checkpoint of checkpoint.py, its weights loaded onto the parameters, and its logits against reference.py.

vLLM's Attention cannot be built here (no attention backend without a GPU platform): a plain causal SDPA over one
sequence stands in for it, constructed with the arguments the model gives vLLM's (and checked). Everything else is
vLLM's own layers, run through their PyTorch implementations. The GPU engine test (test_gpu_vllm_model.py) checks
the real attention, vLLM's kernels and CUDA graphs.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import DEVICE
from turboquant_vllm.models.cloverlm import reference as ref
from turboquant_vllm.models.cloverlm import vllm_model
from turboquant_vllm.models.cloverlm.checkpoint import write_checkpoint

GQA = ref.CloverLMShape(vocab_size=97, num_blocks=2, heads=6, d_head=16, ratio=3, max_context=64)
UNTIED = ref.CloverLMShape(vocab_size=80, num_blocks=1, heads=4, d_head=32, ratio=1, max_context=64,
                           weight_tying=False)


def weights(shape: ref.CloverLMShape, seed: int) -> dict[str, torch.Tensor]:
    """reference.random_weights with an embedding (and head) of std 0.5: logits of a few units, so a wrong step
    shows in the log-probabilities (at CloverLM's init std 0.02 they are all near -log(vocab))."""
    w = ref.random_weights(shape, seed=seed)
    for name in ("transformer.emb.weight", "transformer.linear.weight"):
        if name in w:
            w[name] = (w[name].float() * 25).to(w[name].dtype)
    return w


class CausalSDPA(torch.nn.Module):
    """Stands in for vLLM's Attention: one sequence, causal, GQA; q, k, v as vLLM's gets them (tokens, heads * d)."""

    built: list[dict] = []

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, cache_config=None, quant_config=None,
                 prefix=""):
        super().__init__()
        self.heads, self.d, self.scale, self.kv = num_heads, head_size, scale, num_kv_heads or num_heads
        CausalSDPA.built.append(dict(num_heads=num_heads, head_size=head_size, scale=scale, num_kv_heads=self.kv,
                                     prefix=prefix))

    def forward(self, q, k, v):
        t, group, dtype = q.shape[0], self.heads // self.kv, q.dtype
        q = q.float().view(t, self.heads, self.d).transpose(0, 1)
        k = k.float().view(t, self.kv, self.d).transpose(0, 1).repeat_interleave(group, dim=0)
        v = v.float().view(t, self.kv, self.d).transpose(0, 1).repeat_interleave(group, dim=0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.transpose(0, 1).reshape(t, self.heads * self.d).to(dtype)



@pytest.fixture
def sdpa(monkeypatch):
    CausalSDPA.built = []
    monkeypatch.setattr(vllm_model, "Attention", CausalSDPA)
    return CausalSDPA


def build(model_dir, dtype: torch.dtype, quant_config=None):
    """The model as vLLM's loader builds it (its VllmConfig current, params in `dtype`), uncompiled and with vLLM's
    PyTorch implementations of its custom ops."""
    from vllm.config import (CompilationConfig, CompilationMode, DeviceConfig, ModelConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.utils.torch_utils import set_default_torch_dtype

    vllm_model.register()
    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype=dtype)
    config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device=DEVICE), quant_config=quant_config,
                        compilation_config=CompilationConfig(mode=CompilationMode.NONE, custom_ops=["none"]))
    with set_current_vllm_config(config), set_default_torch_dtype(dtype), torch.device(DEVICE):
        return vllm_model.CloverLMForCausalLM(vllm_config=config)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids.to(DEVICE), torch.arange(len(ids), device=DEVICE))).float().cpu()


def test_register_makes_the_architecture_and_the_config_known(tmp_path):
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.config import ModelConfig, ParallelConfig

    vllm_model.register()
    vllm_model.register()  # idempotent
    assert "CloverLMForCausalLM" in ModelRegistry.get_supported_archs()
    out = write_checkpoint(GQA, ref.random_weights(GQA), tmp_path / "ckpt")
    config = AutoConfig.from_pretrained(out)
    assert type(config).__name__ == "CloverLMConfig" and config.tie_word_embeddings
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (6, 2, 16)
    model_config = ModelConfig(model=str(out), skip_tokenizer_init=True, dtype="bfloat16")
    assert model_config.architectures == ["CloverLMForCausalLM"]
    assert model_config.get_num_kv_heads(ParallelConfig()) == 2
    model_cls, arch = ModelRegistry.resolve_model_cls(["CloverLMForCausalLM"], model_config)
    assert model_cls is vllm_model.CloverLMForCausalLM and arch == "CloverLMForCausalLM"


def test_the_checkpoint_loads_onto_every_parameter(tmp_path, one_rank, sdpa):
    w = weights(GQA, seed=1)
    model = build(write_checkpoint(GQA, w, tmp_path / "ckpt"), torch.bfloat16)
    params = dict(model.named_parameters())
    loaded = model.load_weights(iter(w.items()))
    assert loaded == set(params)  # every parameter filled, by a checkpoint tensor of its own
    assert len(w) == len(params) + 2 * 2  # lq, lk, lv: one parameter per block
    b = "transformer.blocks.1"
    qkv = torch.cat([w[f"{b}.mhsa.{n}.weight"] for n in ("lq", "lk", "lv")])
    assert params[f"{b}.mhsa.qkv.weight"].shape == (96 + 2 * 32, 96)
    assert torch.equal(params[f"{b}.mhsa.qkv.weight"], qkv)
    assert torch.equal(params[f"{b}.mlp.l1.weight"], w[f"{b}.mlp.l1.0.weight"])
    assert params[f"{b}.mhsa.scale"].dtype == torch.float32 and params[f"{b}.mhsa.scale"].shape == (6,)
    assert torch.equal(params[f"{b}.mhsa.scale"], w[f"{b}.mhsa.scale"].float().view(6))
    assert params["transformer.out_norm.weight"].dtype == torch.float32
    assert torch.equal(params["transformer.out_norm.weight"], w["transformer.out_norm.weight"].float())
    emb = params["transformer.emb.weight"]
    assert torch.equal(emb[:97], w["transformer.emb.weight"]) and model.head is model.transformer.emb
    # attention as vLLM's is asked for: softmax scale 1.0, the KV heads of GQA, one layer name per block
    assert [a["prefix"] for a in sdpa.built] == ["transformer.blocks.0.mhsa.attn", "transformer.blocks.1.mhsa.attn"]
    assert all((a["num_heads"], a["num_kv_heads"], a["head_size"], a["scale"]) == (6, 2, 16, 1.0)
               for a in sdpa.built)
    with pytest.raises(KeyError, match="transformer.blocks.0.mhsa.lx.weight"):
        model.load_weights([("transformer.blocks.0.mhsa.lx.weight", torch.zeros(3))])


def test_a_tied_checkpoint_may_name_the_head_instead_of_the_embedding(tmp_path, one_rank, sdpa):
    w = weights(GQA, seed=2)
    model = build(write_checkpoint(GQA, w, tmp_path / "ckpt"), torch.float32)
    renamed = {("transformer.linear.weight" if k == "transformer.emb.weight" else k): v for k, v in w.items()}
    assert model.load_weights(renamed.items()) == {n for n, _ in model.named_parameters()}
    assert torch.equal(model.transformer.emb.weight[:97], w["transformer.emb.weight"].float())


def test_the_q_scale_is_sharded_with_the_heads(monkeypatch):
    """Under tensor parallelism rank r holds heads [r h, (r + 1) h) of QKVParallelLinear: the scale's as well."""
    attn = object.__new__(vllm_model.CloverLMAttention)
    attn.heads = 3
    scale = torch.arange(12.0).view(1, 12, 1, 1)
    param = torch.nn.Parameter(torch.empty(3), requires_grad=False)
    for rank in range(4):
        monkeypatch.setattr(vllm_model, "get_tensor_model_parallel_rank", lambda r=rank: r)
        attn._load_scale(param, scale)
        assert param.tolist() == [3.0 * rank, 3.0 * rank + 1, 3.0 * rank + 2]
    monkeypatch.setattr(vllm_model, "get_tensor_model_parallel_rank", lambda: 4)
    with pytest.raises(ValueError, match="12 heads"):
        attn._load_scale(param, scale)


@pytest.mark.parametrize("shape", [GQA, UNTIED], ids=["gqa-tied", "mha-untied"])
def test_fp32_logits_are_the_reference(tmp_path, one_rank, sdpa, shape, monkeypatch):
    """In fp32 every step is reference.py's (vLLM's interleaved RoPE, the norms, the Q scale, the post-norms)."""
    w = weights(shape, seed=3)
    model = build(write_checkpoint(shape, w, tmp_path / "ckpt"), torch.float32)
    model.load_weights(w.items())
    ids = torch.randint(0, shape.vocab_size, (40,), generator=torch.Generator().manual_seed(4))
    want = ref.forward(w, shape, ids)
    assert want.std() > 1  # logits that tell a wrong step
    got = logits(model, ids)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # a model without the Q scale, or with the pairs of RoPE split in halves (neox), is not the reference
    for block in model.transformer.blocks:
        block.mhsa.scale.data.fill_(1.0)
    assert (logits(model, ids) - want).abs().max() > 0.1
    model.load_weights(w.items())
    torch.testing.assert_close(logits(model, ids), want, rtol=1e-4, atol=1e-4)
    for block in model.transformer.blocks:  # (one module, shared by get_rope with every model of this d_head)
        monkeypatch.setattr(block.mhsa.rotary_emb, "is_neox_style", True)
    assert (logits(model, ids) - want).abs().max() > 0.1


def test_bf16_log_probs_are_near_the_reference(tmp_path, one_rank, sdpa):
    w = weights(GQA, seed=5)
    model = build(write_checkpoint(GQA, w, tmp_path / "ckpt"), torch.bfloat16)
    model.load_weights(w.items())
    ids = torch.randint(0, 97, (60,), generator=torch.Generator().manual_seed(6))
    want = ref.forward(w, GQA, ids).log_softmax(-1)
    got = logits(model, ids).log_softmax(-1)
    diff = (got - want).abs()
    # bf16's rounding: 0.033 and 0.18 here; a Q scale off by 25 % gives 0.75 and 4.5, RoPE's pairs in halves 2.7, 15
    assert diff.mean() < 0.08 and diff.max() < 0.4, (diff.mean(), diff.max())


def test_the_norms_are_torchs_rmsnorm(one_rank):
    """fp32 weights and epsilon 2^-23: torch.nn.RMSNorm's result for bf16 activations, down to the rounding, on
    rows small enough for epsilon to count."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device=DEVICE))):
        norm = vllm_model._norm(96)
    assert norm.variance_epsilon == ref.NORM_EPS == 2.0 ** -23 and norm.weight.dtype == torch.float32
    module = torch.nn.RMSNorm(96).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        module.weight.copy_(1 + torch.randn(96, generator=gen) * 0.1)
        norm.weight.copy_(module.weight.float())
        x = (torch.randn(9, 96, generator=gen) * 1e-3).to(torch.bfloat16)
        assert torch.equal(norm.forward_native(x), module(x))


@pytest.mark.slow  # a vLLM model quantized on the CPU: ~10 s (CI's slow tier)
def test_quartet2_quantizes_the_linears_not_the_embedding(tmp_path, one_rank, sdpa, monkeypatch):
    """`-q quartet2`: qkv, lo, l1, l2 get its method (through the prefixes the model gives them); the embedding
    and norms stay. Its emulation (W4A4) is as near the reference as the reference with NVFP4 weights is."""
    from turboquant_vllm.quant.quartet2.plugin import config, method, paths

    monkeypatch.setenv(paths.PATH_ENV, "emulate")
    w = weights(GQA, seed=8)
    model = build(write_checkpoint(GQA, w, tmp_path / "ckpt"), torch.bfloat16, config.Quartet2Config())
    model.load_weights(w.items())
    quantized = {n for n, m in model.named_modules() if isinstance(getattr(m, "quant_method", None),
                                                                   method.Quartet2LinearMethod)}
    assert quantized == {f"transformer.blocks.{i}.{n}" for i in range(2)
                         for n in ("mhsa.qkv", "mhsa.lo", "mlp.l1", "mlp.l2")}
    for _, module in model.named_modules():
        if isinstance(getattr(module, "quant_method", None), method.Quartet2LinearMethod):
            module.quant_method.process_weights_after_loading(module)
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(9))
    want = ref.forward(w, GQA, ids).log_softmax(-1)
    got = logits(model, ids).log_softmax(-1)
    assert torch.isfinite(got).all()
    quantized_weights = {k: nvfp4_weight(v) if k.endswith(("lq.weight", "lk.weight", "lv.weight", "lo.weight",
                                                           "l1.0.weight", "l2.weight")) else v for k, v in w.items()}
    weight_noise = (ref.forward(quantized_weights, GQA, ids).log_softmax(-1) - want).abs().mean()  # 0.9 here
    diff = (got - want).abs().mean()  # 1.3 here; a Q scale off by 25 % gives 0.75, RoPE's pairs in halves 2.7
    assert weight_noise > 0.1 and diff < 2 * weight_noise, (diff, weight_noise)
    assert torch.corrcoef(torch.stack((got.flatten(), want.flatten())))[0, 1] > 0.9


def nvfp4_weight(w: torch.Tensor) -> torch.Tensor:
    """w through quartet2's NVFP4 quantization and back."""
    from turboquant_vllm.quant.quartet2.kernels.dequantize.naive import unscaled_values
    from turboquant_vllm.quant.quartet2.kernels.quantize import quantize_weight

    q = quantize_weight(w)
    return (unscaled_values(q.packed, q.scales) * q.tensor_scale.float()).to(w.dtype)


@pytest.mark.slow  # a vLLM model from an NVFP4 checkpoint on the CPU: ~16 s (CI's slow tier)
def test_an_nvfp4_checkpoint_loads_as_written(tmp_path, one_rank, sdpa, monkeypatch):
    """checkpoint.write_nvfp4_checkpoint's files, claimed by quartet2 from hf_quant_config.json and loaded by the
    model's load_weights: every linear holds the written codes, scales and tensor scales (qkv: three parts, one
    tensor scale each), the embedding and norms stay bf16; the W4A4 emulation is as near the reference as the
    on-the-fly test's."""
    from safetensors.torch import load_file
    from vllm.config import ModelConfig

    from turboquant_vllm import plugins
    from turboquant_vllm.models.cloverlm.checkpoint import nvfp4_quant_config, write_nvfp4_checkpoint
    from turboquant_vllm.quant.quartet2 import nvfp4
    from turboquant_vllm.quant.quartet2.plugin import config, method, paths

    monkeypatch.setenv(paths.PATH_ENV, "emulate")
    shape = ref.CloverLMShape(vocab_size=160, num_blocks=1, heads=4, d_head=64, ratio=2, max_context=64)
    w = weights(shape, seed=10)
    out = write_nvfp4_checkpoint(shape, w, tmp_path / "nvfp4")
    plugins.register()
    assert ModelConfig(model=str(out), skip_tokenizer_init=True, dtype="bfloat16").quantization == "quartet2"
    model = build(out, torch.bfloat16, config.Quartet2Config.from_config(nvfp4_quant_config()))
    assert model.load_weights(load_file(str(out / "model.safetensors")).items()) == set(dict(model.named_parameters()))
    for _, module in model.named_modules():
        if isinstance(getattr(module, "quant_method", None), method.Quartet2LinearMethod):
            module.quant_method.process_weights_after_loading(module)
    p = "transformer.blocks.0"
    parts = [nvfp4.quantize(w[f"{p}.mhsa.{n}.weight"].float()) for n in ("lq", "lk", "lv")]
    qkv = model.transformer.blocks[0].mhsa.qkv
    assert torch.equal(qkv.weight_packed, torch.cat([nvfp4.pack(q.codes) for q in parts]))
    assert torch.equal(qkv.weight_scales.view(torch.uint8), torch.cat([q.scales.view(torch.uint8) for q in parts]))
    assert torch.equal(qkv.weight_tensor_scale, torch.cat([q.tensor_scale.expand(n) for q, n in zip(parts, (256, 128,
                                                                                                           128))]))
    l2 = nvfp4.quantize(w[f"{p}.mlp.l2.weight"].float())
    assert torch.equal(model.transformer.blocks[0].mlp.l2.weight_packed, nvfp4.pack(l2.codes))
    assert model.transformer.emb.weight.dtype == torch.bfloat16
    assert torch.equal(model.transformer.emb.weight[:160], w["transformer.emb.weight"])
    ids = torch.randint(0, 160, (24,), generator=torch.Generator().manual_seed(11))
    want = ref.forward(w, shape, ids).log_softmax(-1)
    got = logits(model, ids).log_softmax(-1)
    dequantized = {k: nvfp4_weight(v) if k.endswith(("lq.weight", "lk.weight", "lv.weight", "lo.weight",
                                                     "l1.0.weight", "l2.weight")) else v for k, v in w.items()}
    weight_noise = (ref.forward(dequantized, shape, ids).log_softmax(-1) - want).abs().mean()
    assert torch.isfinite(got).all() and (got - want).abs().mean() < 2 * weight_noise, weight_noise
