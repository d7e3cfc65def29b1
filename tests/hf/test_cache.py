"""TurboQuantCache: what it stores is core's quantizer output, what attention gets is its reconstruction."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

from turboquant_vllm.core.calibration import KeyCalibration
from turboquant_vllm.core.presets import get_preset
from turboquant_vllm.core.quantizer import Quantizer
from turboquant_vllm.hf.cache import TurboQuantCache, TurboQuantLayer
from turboquant_vllm.hf.demo import with_cache

D = 64


def kw(cache) -> dict:
    """The Cache as the installed transformers takes it (`cache=`, or `past_key_values=` before the rename)."""
    return with_cache(LlamaForCausalLM, cache)


@pytest.fixture(autouse=True)
def quiet_transformers():
    logging.set_verbosity_error()  # generate() warns about the random model's unset pad / attention mask


def kv(batch: int, heads: int, tokens: int, seed: int = 0, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, tokens, D, generator=gen).to(dtype) for _ in range(2))


def round_trip(bits: int, x: torch.Tensor) -> torch.Tensor:
    q = Quantizer(bits, D)
    return q.dequantize(*q.quantize(x))


@pytest.fixture(scope="module")
def tiny_model():
    """2 layers, head_dim 64, GQA 2; a small vocabulary keeps the random model's greedy picks apart."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=D, max_position_embeddings=256,
                         pad_token_id=0, initializer_range=0.01)
    return LlamaForCausalLM(config).eval()


def prompt(batch: int = 4, tokens: int = 33) -> torch.Tensor:
    return torch.randint(1, 32, (batch, tokens), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("preset", ["tq4", "k4v3", "k3v2"])
def test_stores_cores_codes_and_returns_their_reconstruction(preset):
    p = get_preset(preset)
    k, v = kv(2, 3, 37)  # an odd token count
    layer = TurboQuantLayer(preset)
    keys, values = layer.update(k, v)
    for x, bits, slot, returned in ((k, p.k_bits, 0, keys), (v, p.v_bits, 3, values)):
        q = Quantizer(bits, D)
        codes, norms = q.quantize(x)
        assert torch.equal(layer._stored[slot].view, codes)
        torch.testing.assert_close(layer._stored[slot + 1].view, norms, rtol=1e-6, atol=0)
        torch.testing.assert_close(returned, q.dequantize(codes, norms), rtol=1e-5, atol=1e-6)


def test_returns_the_models_dtype():
    k, v = kv(1, 2, 5, dtype=torch.bfloat16)
    keys, values = TurboQuantCache().update(k, v, 0)
    assert keys.dtype == values.dtype == torch.bfloat16
    torch.testing.assert_close(keys, round_trip(4, k.float()).bfloat16(), rtol=0.01, atol=0.01)


def test_chunked_updates_equal_one_shot():
    k, v = kv(2, 3, 45, seed=1)
    whole, chunked = TurboQuantLayer("tq3"), TurboQuantLayer("tq3")
    want = whole.update(k, v)
    start = 0
    for n in (7, 1, 1, 29, 1, 5, 1):  # a prefill in chunks, then single decode tokens
        got = chunked.update(k[:, :, start : start + n], v[:, :, start : start + n])
        start += n
        assert got[0].shape[2] == start == chunked.get_seq_length()
    for a, b in zip(whole._stored, chunked._stored):
        if a.view.dtype == torch.uint8:  # the stored codes; norms and reconstructions up to the matmul's rounding
            assert torch.equal(a.view, b.view)
        torch.testing.assert_close(a.view, b.view, rtol=1e-6, atol=1e-6)
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("preset", ["tq4", "k3v2"])
def test_bytes_are_the_presets_record_size(preset):
    batch, heads, layers = 2, 3, 4
    cache = TurboQuantCache(preset)
    for step, tokens in enumerate((13, 1, 1)):
        for layer in range(layers):
            cache.update(*kv(batch, heads, tokens, seed=step), layer)
    per_head = get_preset(preset).bytes_per_token_per_head(D)
    assert cache.nbytes() == per_head * batch * 15 * heads * layers
    assert cache.get_seq_length() == 15


def test_a_bf16_layer_stores_the_tensors_and_counts_their_bytes():
    cache = TurboQuantCache("tq4", layer_presets={1: "bf16"})
    k, v = kv(1, 2, 9, dtype=torch.bfloat16)
    for layer in range(3):
        cache.update(k, v, layer)
    assert [layer.preset is None for layer in cache.layers] == [False, True, False]
    assert cache.layers[1].nbytes() == 2 * k.nbytes
    assert cache.layers[0].nbytes() == 9 * 2 * 72  # 9 tokens, 2 KV heads, tq4 at d 64: 72 B


def test_calibrated_keys_are_quantized_centred_and_scaled():
    gen = torch.Generator().manual_seed(3)
    heads = 3
    cal = KeyCalibration(torch.randn(heads, D, generator=gen) * 5, torch.rand(heads, D, generator=gen) + 0.5)
    k, v = kv(1, heads, 21, seed=4)
    k = k + cal.mean[:, None]  # keys sharing a large mean per head, as real models' keys do
    keys, _ = TurboQuantCache("tq4", calibration={0: cal}).update(k, v, 0)
    # core's view: (tokens, kv_heads, head_dim)
    tokens_first = k[0].transpose(0, 1)
    want = round_trip(4, cal.keys(tokens_first)) * cal.scale + cal.mean
    torch.testing.assert_close(keys[0].transpose(0, 1), want, rtol=1e-6, atol=1e-5)
    plain, _ = TurboQuantCache("tq4").update(k, v, 0)
    assert (keys - k).norm() < 0.5 * (plain - k).norm()  # the mean no longer eats the bits
    # what vLLM's kernel computes instead: (q * scale) . k_hat over the quantized (k - mean) / scale
    q = torch.randn(5, heads, D, generator=gen)
    kernel_keys = round_trip(4, cal.keys(tokens_first))
    ours = torch.einsum("qhd,khd->hqk", q, keys[0].transpose(0, 1)).softmax(-1)
    kernel = torch.einsum("qhd,khd->hqk", cal.queries(q), kernel_keys).softmax(-1)
    torch.testing.assert_close(ours, kernel, rtol=1e-4, atol=1e-6)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="unknown TurboQuant preset"):
        TurboQuantCache("tq9")
    with pytest.raises(ValueError, match="unknown TurboQuant preset"):
        TurboQuantCache(layer_presets={0: "fp8"})
    cal = KeyCalibration(torch.zeros(2, D), torch.ones(2, D))
    with pytest.raises(ValueError, match="bf16"):
        TurboQuantCache(layer_presets={0: "bf16"}, calibration={0: cal})
    with pytest.raises(ValueError, match="3 of dim 64"):
        TurboQuantCache(calibration={0: cal}).update(*kv(1, 3, 2), 0)


@torch.no_grad()
def test_bf16_layers_are_bit_exact_to_dynamic_cache(tiny_model):
    ids = prompt()
    ref_cache, ours = DynamicCache(), TurboQuantCache(layer_presets={0: "bf16", 1: "bf16"})
    ref = tiny_model(ids, **kw(ref_cache), use_cache=True).logits
    assert torch.equal(tiny_model(ids, **kw(ours), use_cache=True).logits, ref)
    step = ids[:, -1:]
    assert torch.equal(tiny_model(step, **kw(ours), use_cache=True).logits,
                       tiny_model(step, **kw(ref_cache), use_cache=True).logits)
    mixed = TurboQuantCache(layer_presets={0: "bf16"})
    tiny_model(ids, **kw(mixed), use_cache=True)
    tiny_model(step, **kw(mixed), use_cache=True)
    assert torch.equal(mixed.layers[0].keys, ref_cache.layers[0].keys)
    assert torch.equal(mixed.layers[0].values, ref_cache.layers[0].values)
    assert mixed.layers[1].nbytes() == get_preset("tq4").bytes_per_token_per_head(D) * (ids.numel() + 4) * 2


@torch.no_grad()
def test_logits_stay_close_to_dynamic_cache_and_order_by_bits(tiny_model):
    ids = prompt()
    ref = tiny_model(ids, **kw(DynamicCache()), use_cache=True).logits
    err, agree = {}, {}
    for preset in ("tq4", "tq3", "tq2"):
        out = tiny_model(ids, **kw(TurboQuantCache(preset)), use_cache=True).logits
        assert torch.isfinite(out).all()
        err[preset] = ((out - ref).norm() / ref.norm()).item()
        agree[preset] = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert err["tq4"] < 0.15 and err["tq4"] < err["tq3"] < err["tq2"], err
    assert agree["tq4"] > 0.8, agree


@torch.no_grad()
def test_chunked_prefill_then_decode_matches_one_shot(tiny_model):
    ids = prompt(batch=2, tokens=30)
    one_shot = tiny_model(ids, **kw(TurboQuantCache("tq4")), use_cache=True).logits
    cache, outs = TurboQuantCache("tq4"), []
    for start, end in ((0, 11), (11, 12), (12, 29), (29, 30)):
        outs.append(tiny_model(ids[:, start:end], **kw(cache), use_cache=True).logits)
    torch.testing.assert_close(torch.cat(outs, 1), one_shot, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_greedy_generation_runs_and_mostly_agrees(tiny_model):
    ids, new = prompt(), 24
    ref = tiny_model.generate(ids, max_new_tokens=new, do_sample=False, **kw(DynamicCache()))
    cache = TurboQuantCache("tq4")
    ours = tiny_model.generate(ids, max_new_tokens=new, do_sample=False, **kw(cache))
    assert ours.shape == ref.shape and torch.equal(ours[:, : ids.shape[1]], ids)
    # the last token is generated, never fed back: the cache holds one fewer
    assert cache.get_seq_length() == ids.shape[1] + new - 1
    assert cache.nbytes() == get_preset("tq4").bytes_per_token_per_head(D) * 4 * cache.get_seq_length() * 2 * 2
    assert (ours[:, ids.shape[1]:] == ref[:, ids.shape[1]:]).float().mean() > 0.5
    beams = tiny_model.generate(ids[:2], max_new_tokens=4, do_sample=False, num_beams=2, **kw(TurboQuantCache()))
    assert beams.shape == (2, ids.shape[1] + 4)


@pytest.mark.parametrize("layers", [{}, {0: "bf16"}])
def test_crop_forgets_tokens_that_the_next_update_replaces(layers):
    """crop(-n) (assisted decoding rejecting drafts): the cache then equals one that never saw those tokens."""
    k, v = kv(2, 3, 12)
    cropped, fresh = TurboQuantCache("tq4", layers), TurboQuantCache("tq4", layers)
    cropped.update(k[:, :, :10], v[:, :, :10], 0)
    cropped.crop(-3)
    assert cropped.get_seq_length() == 7
    got = cropped.update(k[:, :, 10:], v[:, :, 10:], 0)
    fresh.update(k[:, :, :7], v[:, :, :7], 0)
    want = fresh.update(k[:, :, 10:], v[:, :, 10:], 0)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and cropped.nbytes() == fresh.nbytes()
    cropped.crop(0)
    assert cropped.get_seq_length() == 9
    with pytest.raises(ValueError, match="minus the number"):
        cropped.crop(4)


@torch.no_grad()
def test_prompt_lookup_decoding_runs_on_the_cache(tiny_model):
    """transformers' n-gram speculation (prompt lookup: drafts verified, rejected ones cropped) on a TurboQuantCache
    gives greedy decoding's length and, on a repetitive prompt, mostly its tokens."""
    ids = torch.tensor([[5, 6, 7, 8, 9] * 6])
    greedy = tiny_model.generate(ids, max_new_tokens=16, do_sample=False, **kw(TurboQuantCache("tq4")))
    looked_up = tiny_model.generate(ids, max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=3,
                                    **kw(TurboQuantCache("tq4")))
    assert looked_up.shape == greedy.shape
    assert (looked_up[:, ids.shape[1]:] == greedy[:, ids.shape[1]:]).float().mean() > 0.5
