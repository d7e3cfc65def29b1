"""CloverLM as a vLLM 0.33 model (architecture "CloverLMForCausalLM"), computing what reference.py computes.

The module tree keeps the checkpoint's names (transformer.emb, transformer.blocks.{i}.mhsa, .out_att_norm, .mlp.l1,
.mlp.l2, .out_mlp_norm, transformer.out_norm, transformer.linear when untied), so quantization configs that name
modules (CloverLM NVFP4's exclude_modules ["emb", "linear"]) see CloverLM's names. The one fused layer is
mhsa.qkv (lq, lk, lv stacked, as vLLM's QKVParallelLinear shards heads over tensor-parallel ranks); the learned
per-head Q scale is sharded with the heads.

Numerics, against reference.py (which is fp32 throughout): linears, attention and the residual stream in the
model's dtype (bf16), as in any vLLM model; RoPE (base 1024, interleaved pairs: vLLM's rotary embedding with
is_neox_style=False and an fp32 table), the L2 normalization of Q and K and the Q scale in fp32, then one rounding
to the attention's dtype; softmax scale 1.0; the RMSNorms with fp32 weights and epsilon 2^-23, which is
torch.nn.RMSNorm's arithmetic (normalize and weigh in fp32, round once) where vLLM's bf16 weight would round the
normalized value before weighing it.

Registered by the package's vLLM entry point (turboquant_vllm.plugins -> models.cloverlm.register, which names
this module's class by string); `register` is re-exported here.
"""

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vllm.compilation.decorators import support_torch_compile
from vllm.config import CacheConfig, VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from . import ARCH, register  # noqa: F401  (register: re-exported)
from .config import CloverLMConfig
from .reference import NORM_EPS, ROPE_BASE

# checkpoint module -> (vLLM module, shard of the fused layer)
STACKED = ((".mhsa.lq.", ".mhsa.qkv.", "q"), (".mhsa.lk.", ".mhsa.qkv.", "k"), (".mhsa.lv.", ".mhsa.qkv.", "v"))
RENAMED = ((".mlp.l1.0.", ".mlp.l1."),)  # CloverLM's l1 is Sequential(Linear, ReLU^2)


def _norm(d: int) -> RMSNorm:
    """torch.nn.RMSNorm(d) as CloverLM trained it: epsilon fp32's (2^-23), the weight kept in fp32."""
    return RMSNorm(d, eps=NORM_EPS, dtype=torch.float32)


class CloverLMAttention(nn.Module):
    def __init__(self, config: CloverLMConfig, max_position: int, cache_config: CacheConfig | None,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        d = config.heads * config.d_head
        self.d_head = config.d_head
        self.qkv = QKVParallelLinear(d, config.d_head, config.heads, config.heads // config.ratio, bias=False,
                                     quant_config=quant_config, prefix=f"{prefix}.qkv")
        self.heads, self.kv_heads = self.qkv.num_heads, self.qkv.num_kv_heads  # this rank's
        self.q_size, self.kv_size = self.heads * self.d_head, self.kv_heads * self.d_head
        self.lo = RowParallelLinear(d, d, bias=False, quant_config=quant_config, prefix=f"{prefix}.lo")
        # the checkpoint's (1, heads, 1, 1), as this rank's heads
        self.scale = nn.Parameter(torch.empty(self.heads, dtype=torch.float32), requires_grad=False)
        self.scale.weight_loader = self._load_scale
        self.rotary_emb = get_rope(config.d_head, max_position=max_position, is_neox_style=False,
                                   rope_parameters={"rope_theta": ROPE_BASE}, dtype=torch.float32)
        self.attn = Attention(self.heads, self.d_head, scale=1.0, num_kv_heads=self.kv_heads,
                              cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.attn")

    def _load_scale(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        loaded = loaded.reshape(-1)
        start = get_tensor_model_parallel_rank() * self.heads
        if loaded.numel() < start + self.heads:
            raise ValueError(f"CloverLM Q scale of {loaded.numel()} heads, {self.heads} per rank wanted")
        param.data.copy_(loaded[start:start + self.heads])

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q.float(), k.float())
        q = F.normalize(q.view(-1, self.heads, self.d_head), dim=-1) * self.scale[:, None]
        k = F.normalize(k.view(-1, self.kv_heads, self.d_head), dim=-1)
        out = self.attn(q.reshape(-1, self.q_size).to(v.dtype), k.reshape(-1, self.kv_size).to(v.dtype), v)
        out, _ = self.lo(out)
        return out


class CloverLMMLP(nn.Module):
    def __init__(self, d: int, d_ff: int, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.l1 = ColumnParallelLinear(d, d_ff, bias=False, quant_config=quant_config, prefix=f"{prefix}.l1")
        self.l2 = RowParallelLinear(d_ff, d, bias=False, quant_config=quant_config, prefix=f"{prefix}.l2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.l1(x)
        out, _ = self.l2(F.relu(h).square())
        return out


class CloverLMBlock(nn.Module):
    """Post-sublayer norms: x + norm(attn(x)), then x + norm(mlp(x))."""

    def __init__(self, config: CloverLMConfig, max_position: int, cache_config: CacheConfig | None,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        d = config.heads * config.d_head
        self.mhsa = CloverLMAttention(config, max_position, cache_config, quant_config, f"{prefix}.mhsa")
        self.out_att_norm = _norm(d)
        self.mlp = CloverLMMLP(d, 4 * d, quant_config, f"{prefix}.mlp")
        self.out_mlp_norm = _norm(d)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.out_att_norm(self.mhsa(positions, x))
        return x + self.out_mlp_norm(self.mlp(x))


@support_torch_compile
class CloverLMModel(nn.Module):
    """CloverLM's `transformer`: embedding, blocks, final norm, and the head when not tied to the embedding."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        d = config.heads * config.d_head
        max_position = max(config.max_position_embeddings, vllm_config.model_config.max_model_len)
        self.emb = VocabParallelEmbedding(config.vocab_size, d, prefix=f"{prefix}.emb")
        self.blocks = nn.ModuleList(
            CloverLMBlock(config, max_position, vllm_config.cache_config, quant_config, f"{prefix}.blocks.{i}")
            for i in range(config.num_blocks))
        self.out_norm = _norm(d)
        if not config.weight_tying:
            self.linear = ParallelLMHead(config.vocab_size, d, bias=False, quant_config=quant_config,
                                         prefix=f"{prefix}.linear")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.emb(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: object | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.emb(input_ids)
        for block in self.blocks:
            x = block(positions, x)
        return self.out_norm(x)


class CloverLMForCausalLM(nn.Module):
    packed_modules_mapping = {"qkv": ["lq", "lk", "lv"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        if config.heads % config.ratio or config.d_head % 2:
            raise ValueError(f"CloverLM needs heads ({config.heads}) a multiple of ratio ({config.ratio}) and an "
                             f"even d_head ({config.d_head})")
        self.transformer = CloverLMModel(vllm_config=vllm_config, prefix=f"{prefix}transformer")
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @property
    def head(self) -> VocabParallelEmbedding:
        return self.transformer.emb if self.config.weight_tying else self.transformer.linear

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.transformer.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: object | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.transformer(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.head, hidden_states)

    @staticmethod
    def param_name(name: str, tied: bool) -> tuple[str, str | None]:
        """The parameter a checkpoint tensor loads into, and its shard of a fused layer (None: not fused)."""
        if tied and name == "transformer.linear.weight":
            return "transformer.emb.weight", None  # a tied checkpoint may keep the head's name for the embedding
        for old, new, shard in STACKED:
            if old in name:
                return name.replace(old, new, 1), shard
        for old, new in RENAMED:
            name = name.replace(old, new, 1)
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            name, shard = self.param_name(ckpt_name, self.config.weight_tying)
            if name not in params:
                raise KeyError(f"CloverLM checkpoint tensor {ckpt_name} (as {name}) has no parameter in the vLLM "
                               f"model")
            param = params[name]
            if shard is None:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
            loaded.add(name)
        return loaded
