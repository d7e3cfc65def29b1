"""AWQ checkpoints of our own making (quant.awq_turbomind.checkpoint): the reference LM quantized, random shapes."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from turboquant_vllm.quant.awq_turbomind import awq_format as awq
from turboquant_vllm.quant.awq_turbomind.checkpoint import quantize_checkpoint, random_checkpoint

REFERENCE_LM = Path(__file__).resolve().parents[3] / "models" / "reference-lm"


def read(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def vllm_reads(config: dict):
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig

    return AutoAWQConfig.from_config(config["quantization_config"])


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    out = tmp_path_factory.mktemp("awq") / "reference-lm-awq"
    return quantize_checkpoint(REFERENCE_LM, out, group_size=128, modules_to_not_convert=["layers.5.mlp.down_proj"])


def test_the_reference_lm_quantized(quantized):
    src, got = read(REFERENCE_LM), read(quantized)
    linears = [k for k in src if k.removesuffix(".weight").rsplit(".", 1)[-1] in
               ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")]
    assert len(linears) == 6 * 7
    for name in linears:
        prefix = name.removesuffix(".weight")
        if prefix == "model.layers.5.mlp.down_proj":  # modules_to_not_convert: kept as it was
            assert torch.equal(got[name], src[name])
            continue
        w = awq.AWQWeight(got[f"{prefix}.qweight"], got[f"{prefix}.qzeros"], got[f"{prefix}.scales"])
        assert w.group_size == 128 and name not in got
        step = w.scales.float().repeat_interleave(128, dim=0)
        assert ((awq.dequantize(w) - src[name].float().T).abs() <= step * 1.0001).all(), name
    for name in set(src) - set(linears):  # embeddings, norms: copied bit for bit
        assert torch.equal(got[name], src[name]), name
    config = json.loads((quantized / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                             "version": "gemm", "modules_to_not_convert": ["layers.5.mlp.down_proj"]}
    assert (quantized / "tokenizer.json").read_bytes() == (REFERENCE_LM / "tokenizer.json").read_bytes()
    cfg = vllm_reads(config)
    assert cfg.group_size == 128 and cfg.modules_to_not_convert == ["layers.5.mlp.down_proj"]


def test_random_checkpoint_of_a_qwen2_shape(tmp_path):
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256,
              "intermediate_size": 640, "num_hidden_layers": 2, "num_attention_heads": 7, "num_key_value_heads": 1,
              "head_dim": 64, "vocab_size": 1000, "tie_word_embeddings": False}
    out = random_checkpoint(config, tmp_path / "qwen2-awq", group_size=64)
    t = read(out)
    assert t["model.layers.1.self_attn.q_proj.qweight"].shape == (256, 7 * 64 // 8)
    assert t["model.layers.1.self_attn.o_proj.scales"].shape == (7 * 64 // 64, 256)
    assert t["model.layers.0.mlp.down_proj.qzeros"].shape == (640 // 64, 256 // 8)
    assert t["model.layers.0.self_attn.k_proj.bias"].shape == (64,) and "lm_head.weight" in t
    w = awq.AWQWeight(*(t[f"model.layers.0.mlp.up_proj.{x}"] for x in ("qweight", "qzeros", "scales")))
    assert 0.015 < awq.dequantize(w).std() < 0.025
    written = json.loads((out / "config.json").read_text())
    assert vllm_reads(written).group_size == 64 and written["torch_dtype"] == "float16"


def test_a_group_size_that_does_not_divide_is_refused(tmp_path):
    with pytest.raises(ValueError, match="multiple of the group size 384"):
        quantize_checkpoint(REFERENCE_LM, tmp_path / "x", group_size=384)
    with pytest.raises(ValueError, match="in_features 256 is not a multiple of the group size 96"):
        random_checkpoint({"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                           "num_key_value_heads": 4, "vocab_size": 10, "num_hidden_layers": 1}, tmp_path / "y", 96)
