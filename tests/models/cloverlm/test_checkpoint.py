"""CloverLM checkpoints beyond bf16 (models.cloverlm.checkpoint): the NVFP4 variant read back by the reader the
quartet2 method loads it with, and the test tokenizer as transformers loads it."""

import json
import subprocess
import sys

import pytest
import torch

from turboquant_vllm.models.cloverlm import reference as ref
from turboquant_vllm.models.cloverlm.checkpoint import (EOS, NVFP4_LINEARS, write_checkpoint, write_nvfp4_checkpoint,
                                                        write_tokenizer)
from turboquant_vllm.quant.quartet2 import nvfp4
from turboquant_vllm.quant.quartet2.kernels.dequantize.naive import unscaled_values
from turboquant_vllm.quant.quartet2.plugin import checkpoint as q2ckpt

# the smallest shape whose linears fill whole 128 x 64 scale tiles: d 256, KV rows 128, d_ff 1024
TILED = ref.CloverLMShape(vocab_size=160, num_blocks=2, heads=4, d_head=64, ratio=2, max_context=64)


def test_nvfp4_checkpoint_reads_back_as_the_quantizer_wrote_it(tmp_path):
    from safetensors.torch import load_file

    w = ref.random_weights(TILED, seed=0)
    out = write_nvfp4_checkpoint(TILED, w, tmp_path / "nvfp4")
    assert q2ckpt.is_cloverlm_nvfp4(json.loads((out / "hf_quant_config.json").read_text()))
    stored = load_file(str(out / "model.safetensors"))
    quantized = [k for k in w if k.endswith(NVFP4_LINEARS)]
    assert len(quantized) == 6 * TILED.num_blocks
    for name in quantized:
        packed, scale, scale_2 = stored[name], stored[f"{name}_scale"], stored[f"{name}_scale_2"]
        assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (w[name].shape[0], w[name].shape[1] // 2)
        assert scale.dtype == torch.float8_e4m3fn and scale_2.dtype == torch.float32 and scale_2.shape == ()
        back = q2ckpt.read_weight(packed, scale, scale_2)
        q = nvfp4.quantize(w[name].float())
        assert torch.equal(back.packed, nvfp4.pack(q.codes)) and torch.equal(back.tensor_scale, q.tensor_scale)
        assert torch.equal(back.scales.view(torch.uint8), q.scales.view(torch.uint8)), name
        # the same values (up to where the tensor scale is multiplied in)
        torch.testing.assert_close(unscaled_values(back.packed, back.scales) * back.tensor_scale,
                                   nvfp4.dequantize(q), rtol=2.5e-7, atol=0)
    # everything else as the bf16 checkpoint has it; the head tied, so absent
    rest = {k: v for k, v in stored.items() if not k.endswith(NVFP4_LINEARS) and "_scale" not in k}
    assert rest.keys() == {k for k in w if not k.endswith(NVFP4_LINEARS)}
    assert all(torch.equal(rest[k], w[k]) for k in rest)


def test_nvfp4_needs_whole_scale_tiles(tmp_path):
    small = ref.CloverLMShape(vocab_size=97, num_blocks=1, heads=6, d_head=16, ratio=3, max_context=64)
    with pytest.raises(ValueError, match="tiles of 128 rows"):
        write_nvfp4_checkpoint(small, ref.random_weights(small), tmp_path / "small")


def test_the_tokenizer_loads_offline_and_round_trips_text(tmp_path):
    """In a fresh interpreter (nothing of this package registered), as vLLM's tokenizer loading does."""
    out = write_checkpoint(TILED, ref.random_weights(TILED), tmp_path / "ckpt")
    write_tokenizer(out, vocab_size=512)
    probe = f"""
import json
from transformers import AutoTokenizer
t = AutoTokenizer.from_pretrained({str(out)!r})
text = "The capital of France is Paris.\\nÜnïcode, digits 2030 and a tab\\t!"
ids = t(text)["input_ids"]
chat = t.apply_chat_template([dict(role="user", content="Hi there")], tokenize=False, add_generation_prompt=True)
print(json.dumps(dict(n=len(t), eos=t.eos_token, eos_id=t.eos_token_id, ids=ids, back=t.decode(ids), chat=chat,
                      every=len(t.decode(list(range(len(t))))), text=text)))
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["n"] == 512 and got["eos"] == EOS and got["eos_id"] is not None
    assert got["back"] == got["text"] and len(got["ids"]) < len(got["text"].encode())  # merges, not bytes only
    assert max(got["ids"]) < 512 and got["every"] > 0
    assert got["chat"] == "<|user|>\nHi there\n<|assistant|>\n"


def test_the_tokenizer_has_exactly_the_vocab_asked_for(tmp_path):
    for size in (300, 512, 2048):  # 2048: more than the corpus merges to, filled up
        doc = json.loads((write_tokenizer(tmp_path / str(size), size) / "tokenizer.json").read_text())
        ids = set(doc["model"]["vocab"].values()) | {t["id"] for t in doc["added_tokens"]}
        assert ids == set(range(size)), size
    with pytest.raises(ValueError, match="256 byte tokens"):
        write_tokenizer(tmp_path / "tiny", 97)
