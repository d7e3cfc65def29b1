"""A transformers Cache that stores what the vLLM backend stores: per token and KV head, packed codes + an fp32 norm.

Keys arrive post-RoPE, as vLLM's cache receives them. ``update`` hands attention the reconstruction of every stored
token (fp32 math, cast to the model's dtype); the reconstruction is kept alongside the codes and grows by the new
tokens only, so a decode step quantizes and dequantizes its own token and nothing else. ``nbytes()`` counts the codes
and norms (the stored format), not that working copy.

With a key calibration (core.calibration) the cache quantizes, per token, the shorter of (k - mean) / scale and
k / scale (the latter's norm stored negated) and gives attention k_hat * scale, plus mean for the centered ones.
vLLM's kernel attends to k_hat with q * scale instead and subtracts q.mean from the uncentered ones' scores, which
shifts every score of a query by the same q.mean: softmax is identical, so the two compute the same attention.

A layer may also be stored unquantized (preset "bf16" in ``layer_presets``): it keeps the model's tensors as they
are, exactly as DynamicCache does.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..core.calibration import MIN_UNCENTERED_NORM, KeyCalibration
from ..core.presets import DEFAULT_PRESET, UNQUANTIZED, Preset, get_preset
from ..core.quantizer import Quantizer


class _Tokens:
    """A tensor (batch, heads, tokens, ...) that grows along tokens with doubling capacity: appending n tokens costs
    O(n) amortized, where torch.cat would copy everything stored so far."""

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None
        self.length = 0

    @property
    def view(self) -> torch.Tensor:
        return self.data[:, :, : self.length]

    def append(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[2]
        if self.data is None or self.length + n > self.data.shape[2]:
            grown = x.new_empty(*x.shape[:2], max(2 * (self.length + n), 64), *x.shape[3:])
            if self.data is not None:
                grown[:, :, : self.length] = self.view
            self.data = grown
        self.data[:, :, self.length : self.length + n] = x
        self.length += n
        return self.view

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens (the storage stays: later appends overwrite the rest)."""
        self.length = min(self.length, max(length, 0))

    def select(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` (beam search reorders them)."""
        if self.data is not None:
            self.data = self.data.index_select(0, index.to(self.data.device))


class TurboQuantLayer(CacheLayerMixin):
    """One attention layer's cache: codes + norms of every token and KV head, or the plain tensors (preset bf16)."""

    is_sliding = False
    is_croppable = True  # every token's codes are its own: crop leaves no trace

    def __init__(self, preset: str = DEFAULT_PRESET, calibration: KeyCalibration | None = None) -> None:
        super().__init__()
        self.preset: Preset | None = None if preset == UNQUANTIZED else get_preset(preset)
        if self.preset is None and calibration is not None:
            raise ValueError("a key calibration applies to quantized layers only, not to a bf16 layer")
        self.calibration = calibration
        self._reset_storage()

    def _reset_storage(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        # quantized: key codes, key norms, key reconstruction, then the same for values; bf16: keys, values
        self._stored = [_Tokens() for _ in range(6 if self.preset else 2)]

    @property
    def _returned(self) -> tuple[_Tokens, _Tokens]:
        """What attention gets: the reconstructions, or the plain tensors of a bf16 layer."""
        return (self._stored[2], self._stored[5]) if self.preset else (self._stored[0], self._stored[1])

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        heads, dim = key_states.shape[1], key_states.shape[-1]
        if self.preset is not None:
            self.key_quantizer = Quantizer(self.preset.k_bits, dim)
            self.value_quantizer = Quantizer(self.preset.v_bits, dim)
        if self.calibration is not None:
            if (self.calibration.num_kv_heads, self.calibration.head_dim) != (heads, dim):
                raise ValueError(f"key calibration for {self.calibration.num_kv_heads} KV heads of dim "
                                 f"{self.calibration.head_dim}, but the layer has {heads} of dim {dim}")
            self.calibration = self.calibration.to(self.device)
        self.is_initialized = True

    def _store(self, quantizer: Quantizer, xs: tuple[torch.Tensor, ...], slots: tuple[int, ...],
               uncentered: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Quantize the fp32 tensors xs (one shape) in one pass, append each one's codes and norms at slots slot and
        slot + 1 of its slot; return their reconstructions (fp32). uncentered (xs[0]'s shape but head_dim): the keys
        whose stored norm is negated (core.calibration's format)."""
        x = torch.stack(xs)
        # Rows of one 2-D matrix, and K with V when their bits agree: each matmul or small op of a decode step is a
        # thread-pool round trip, which costs most of the step on a busy CPU
        codes, norms = quantizer.quantize(x.reshape(-1, x.shape[-1]))
        recon = quantizer.dequantize(codes, norms).view(x.shape).unbind(0)
        norms = norms.view(x.shape[:-1])
        if uncentered is not None:
            norms = torch.cat([torch.where(uncentered, -norms[0].clamp_min(MIN_UNCENTERED_NORM), norms[0])[None],
                               norms[1:]])
        for i, slot in enumerate(slots):
            self._stored[slot].append(codes.view(*x.shape[:-1], -1)[i])
            self._stored[slot + 1].append(norms[i])
        return recon

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens (batch, kv_heads, new tokens, head_dim); return every stored token's K and V."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        key_out, value_out = self._returned
        if self.preset is None:
            self.keys, self.values = key_out.append(key_states), value_out.append(value_states)
            return self.keys, self.values
        cal = self.calibration
        k, v = key_states.detach().float(), value_states.detach().float()
        uncentered = None
        if cal is not None:  # KeyCalibration works on (..., kv_heads, head_dim): heads next to head_dim, and back
            x, centered = cal.choose_keys(k.transpose(1, 2))
            k, uncentered = x.transpose(1, 2), ~centered.transpose(1, 2)
        if self.key_quantizer == self.value_quantizer:
            k_hat, v_hat = self._store(self.key_quantizer, (k, v), (0, 3), uncentered)
        else:
            (k_hat,), (v_hat,) = (self._store(self.key_quantizer, (k,), (0,), uncentered),
                                  self._store(self.value_quantizer, (v,), (3,)))
        if cal is not None:
            k_hat = (k_hat.transpose(1, 2) * cal.scale + centered[..., None] * cal.mean).transpose(1, 2)
        self.keys, self.values = key_out.append(k_hat.to(self.dtype)), value_out.append(v_hat.to(self.dtype))
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._stored[0].length

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        """Bytes this layer stores: codes and norms, or the plain keys and values of a bf16 layer."""
        kept = self._stored if self.preset is None else [self._stored[i] for i in (0, 1, 3, 4)]
        return sum(s.view.nbytes for s in kept if s.data is not None)

    def reset(self) -> None:
        self._reset_storage()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last -tokens_to_remove tokens (transformers' convention: a count <= 0), as assisted and
        prompt-lookup decoding do with rejected drafts; the tokens stored next take their places."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes minus the number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        keep = self.get_seq_length() + tokens_to_remove
        for stored in self._stored:
            stored.truncate(keep)
        self.keys, self.values = (s.view for s in self._returned)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for stored in self._stored:
            stored.select(beam_idx)
        if self.is_initialized:
            self.keys, self.values = (s.view for s in self._returned)


class TurboQuantCache(Cache):
    """TurboQuant KV cache for transformers models: ``model.generate(..., cache=TurboQuantCache("tq4"))``
    (``past_key_values=`` in transformers releases before the argument's rename).

    preset: a core.presets name for every layer; layer_presets: layer index -> preset name or "bf16" (unquantized),
    overriding it; calibration: layer index -> KeyCalibration (quantized layers only). Layers are created as the model
    first updates them, so the cache needs no model config.
    """

    def __init__(self, preset: str = DEFAULT_PRESET, layer_presets: Mapping[int, str] | None = None,
                 calibration: Mapping[int, KeyCalibration] | None = None) -> None:
        self.preset = get_preset(preset).name
        self.layer_presets = {i: p if p == UNQUANTIZED else get_preset(p).name
                              for i, p in (layer_presets or {}).items()}
        self.calibration = dict(calibration or {})
        for i, p in self.layer_presets.items():
            if p == UNQUANTIZED and i in self.calibration:
                raise ValueError(f"layer {i} is stored unquantized (bf16) and also has a key calibration")
        super().__init__(layer_class_to_replicate=self._new_layer)

    def _new_layer(self) -> TurboQuantLayer:
        index = len(self.layers)  # Cache.update appends layers in order, up to the one it updates
        return TurboQuantLayer(self.layer_presets.get(index, self.preset), self.calibration.get(index))

    def nbytes(self) -> int:
        """Bytes stored by every layer: for a quantized layer exactly
        Preset.bytes_per_token_per_head(head_dim) x batch x tokens x KV heads."""
        return sum(layer.nbytes() for layer in self.layers)
