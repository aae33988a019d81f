"""The decoder's shape and numerics, whatever checkpoint format they were read from."""

from __future__ import annotations

from dataclasses import dataclass

# The dtype a GGUF file asks for: its dequantized weights are exact in float32, and the
# engine serves them in bfloat16 only where the CPU multiplies bf16 natively (a GPU
# always), float32 elsewhere (engine/device.choose_dtype).
BF16_WHERE_NATIVE = "bfloat16-where-native"


@dataclass(frozen=True)
class DecoderConfig:
    """The decoder's shape and numerics, read from config.json."""

    arch: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, object], ...] | None
    max_position_embeddings: int
    attention_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    dtype: str  # "float32" | "bfloat16" | "float16" | BF16_WHERE_NATIVE
    eos_token_ids: tuple[int, ...]

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None
