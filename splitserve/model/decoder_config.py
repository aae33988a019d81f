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

    arch: str  # "llama" | "qwen2" | "qwen3" | "qwen3_moe" | "qwen2_moe"
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
    moe: MoeConfig | None = None  # the sparse MLP of a mixture-of-experts model

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None


@dataclass(frozen=True)
class MoeConfig:
    """A sparse mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE): which layers have one, its
    router, and (Qwen2-MoE) the shared expert every token also goes through."""

    num_experts: int
    top_k: int  # experts per token
    moe_intermediate_size: int  # each expert's intermediate width
    norm_topk_prob: bool  # renormalize the top-k router probabilities to sum to 1
    decoder_sparse_step: int  # every step-th layer is sparse ...
    mlp_only_layers: tuple[int, ...]  # ... except these, which keep the dense MLP
    shared_expert_intermediate_size: int = 0  # 0: no shared expert

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """transformers' rule (Qwen3MoeDecoderLayer)."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


def moe_config_from_hf(raw: dict) -> MoeConfig:
    """From a qwen3_moe or qwen2_moe config.json (transformers 5 writes `num_local_experts`)."""
    num_experts = raw.get("num_experts", raw.get("num_local_experts"))
    if num_experts is None:
        raise ValueError("a mixture-of-experts config.json needs num_experts")
    config = MoeConfig(
        num_experts=int(num_experts),
        top_k=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
    )
    if not 0 < config.top_k <= config.num_experts or config.decoder_sparse_step < 1:
        raise ValueError(
            f"num_experts_per_tok {config.top_k} must be in 1..num_experts ({config.num_experts}) "
            f"and decoder_sparse_step ({config.decoder_sparse_step}) positive"
        )
    return config
