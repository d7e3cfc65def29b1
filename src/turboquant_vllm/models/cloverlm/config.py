"""CloverLM's configuration (model_type "cloverlm"), for transformers' AutoConfig: vLLM reads a checkpoint's
config.json through it, and CloverLM's own class comes only as remote code (auto_map, --trust-remote-code), which
the checkpoints of checkpoint.py do not carry. Fields as CloverLM's configuration class has them, the HF names
(hidden_size, num_attention_heads, num_key_value_heads, head_dim, ...) derived from the shape unless given."""

from __future__ import annotations

from transformers import PreTrainedConfig

MODEL_TYPE = "cloverlm"


class CloverLMConfig(PreTrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, vocab_size: int = 32000, num_blocks: int = 4, heads: int = 6, d_head: int = 128,
                 ratio: int = 3, scale_type: str = "1/sqrt(d)", max_context: int = 1024,
                 quartet_2_impl: str | None = "pseudoquant", weight_tying: bool = True, attn_backend: str = "pytorch",
                 hidden_size: int | None = None, intermediate_size: int | None = None,
                 max_position_embeddings: int | None = None, num_attention_heads: int | None = None,
                 num_key_value_heads: int | None = None, head_dim: int | None = None, **kwargs) -> None:
        self.num_blocks, self.heads, self.d_head, self.ratio = num_blocks, heads, d_head, ratio
        self.scale_type, self.max_context, self.quartet_2_impl = scale_type, max_context, quartet_2_impl
        self.weight_tying, self.attn_backend = weight_tying, attn_backend
        self.num_hidden_layers = num_blocks
        self.hidden_size = hidden_size if hidden_size is not None else heads * d_head
        self.intermediate_size = intermediate_size if intermediate_size is not None else 4 * heads * d_head
        self.max_position_embeddings = max_position_embeddings if max_position_embeddings is not None else max_context
        self.num_attention_heads = num_attention_heads if num_attention_heads is not None else heads
        self.num_key_value_heads = num_key_value_heads if num_key_value_heads is not None else heads // ratio
        self.head_dim = head_dim if head_dim is not None else d_head
        kwargs.pop("tie_word_embeddings", None)  # weight_tying decides
        super().__init__(vocab_size=vocab_size, tie_word_embeddings=weight_tying, **kwargs)
