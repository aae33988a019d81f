"""Nemotron-H's config.json read into typed shapes: which mixer each layer is, the
attention and Mamba2 geometry, and the MoE layers' router and experts. Field names of
both NVIDIA's checkpoints (`hybrid_override_pattern`, `mamba_*`) and transformers 5
(`layers_block_type`) are read."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from splitserve.model.decoder_config import DecoderConfig
from splitserve.model.mamba2 import MambaShape

PATTERN_LAYERS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
BLOCK_TYPE_LAYERS = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}


@dataclass(frozen=True)
class NemotronHMoeConfig:
    """An `E` layer (transformers' NemotronHMoE): a sigmoid router with grouped top-k,
    non-gated ReLU² experts, optionally behind a latent projection, and a shared expert."""

    num_experts: int  # n_routed_experts
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # each routed expert's (moe_intermediate_size)
    shared_intermediate_size: int  # the shared expert's (moe_shared_expert_intermediate_size)
    num_groups: int  # n_group: the experts split into groups of equal size ...
    top_groups: int  # topk_group: ... and only the best groups' experts may be chosen
    norm_topk_prob: bool
    routed_scaling_factor: float
    latent_size: int | None  # moe_latent_size: the routed experts run in this width (None: hidden)


@dataclass(frozen=True)
class NemotronHConfig:
    text: DecoderConfig  # vocabulary, attention shape; num_layers = attention layers (KV layers)
    layer_types: tuple[str, ...]  # "mamba" | "attention" | "mlp" | "moe", one per layer
    mamba: MambaShape
    mlp_bias: bool
    moe: NemotronHMoeConfig | None = None  # set when a layer is "moe"

    @property
    def num_mamba_layers(self) -> int:
        return self.layer_types.count("mamba")


def token_ids(value: object) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]  # type: ignore[union-attr]


def layer_types_of(raw: dict) -> tuple[str, ...]:
    if raw.get("layers_block_type"):
        names = [BLOCK_TYPE_LAYERS.get(t) for t in raw["layers_block_type"]]
    else:
        names = [PATTERN_LAYERS.get(c) for c in raw.get("hybrid_override_pattern") or ""]
    if not names or None in names:
        raise ValueError("Nemotron-H config needs hybrid_override_pattern (M, *, -, E) or layers_block_type")
    if (raw.get("num_nextn_predict_layers") or 0) > 0:
        raise ValueError("Nemotron-H multi-token prediction layers are not supported")
    if raw.get("mlp_hidden_act", "relu2") != "relu2" or raw.get("mamba_hidden_act", "silu") != "silu":
        raise ValueError("Nemotron-H activations other than relu2 (MLP) and silu (Mamba) are not supported")
    return tuple(n for n in names if n is not None)


def moe_config_of(raw: dict) -> NemotronHMoeConfig:
    """The MoE layers' shape; ValueError for a router transformers could not run."""
    num_experts = raw.get("n_routed_experts", raw.get("num_local_experts"))
    if num_experts is None:
        raise ValueError("a Nemotron-H with MoE layers ('E') needs n_routed_experts")
    latent = raw.get("moe_latent_size")
    moe = NemotronHMoeConfig(
        num_experts=int(num_experts),
        top_k=int(raw.get("num_experts_per_tok", 2)),
        intermediate_size=int(raw["moe_intermediate_size"]),
        shared_intermediate_size=int(raw["moe_shared_expert_intermediate_size"]),
        num_groups=int(raw.get("n_group", 1)),
        top_groups=int(raw.get("topk_group", 1)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        latent_size=int(latent) if latent is not None else None,
    )
    if moe.num_groups < 1 or moe.num_experts % moe.num_groups:
        raise ValueError(f"n_group ({moe.num_groups}) must divide n_routed_experts ({moe.num_experts})")
    per_group = moe.num_experts // moe.num_groups
    if per_group < 2:  # a group is scored by the sum of its best two experts
        raise ValueError(f"a routing group needs at least 2 experts (n_group {moe.num_groups})")
    if not 1 <= moe.top_groups <= moe.num_groups:
        raise ValueError(f"topk_group ({moe.top_groups}) must be in 1..n_group ({moe.num_groups})")
    if not 1 <= moe.top_k <= moe.top_groups * per_group:
        raise ValueError(
            f"num_experts_per_tok ({moe.top_k}) must be in 1..{moe.top_groups * per_group} "
            "(the experts of topk_group groups)"
        )
    return moe


def load_nemotron_h_config(model_dir: str | Path) -> NemotronHConfig:
    """From config.json, with the field names of both NVIDIA's checkpoints and transformers 5."""
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    layer_types = layer_types_of(raw)
    heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
    eps = float(raw.get("layer_norm_epsilon", 1e-5))
    eos = token_ids(raw.get("eos_token_id"))
    generation_path = model_dir / "generation_config.json"
    if generation_path.is_file():
        generation = json.loads(generation_path.read_text())
        eos += [t for t in token_ids(generation.get("eos_token_id")) if t not in eos]
    text = DecoderConfig(
        arch="nemotron_h",
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=layer_types.count("attention"),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=eps,
        rope_theta=10000.0,  # unused: no positional embedding
        rope_scaling=None,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        attention_bias=bool(raw.get("attention_bias", False)),
        qk_norm=False,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        eos_token_ids=tuple(eos),
    )
    if text.num_layers == 0:
        raise ValueError("a Nemotron-H without attention layers is not supported")
    mamba = MambaShape(
        num_heads=int(raw["mamba_num_heads"]),
        head_dim=int(raw["mamba_head_dim"]),
        state_size=int(raw["ssm_state_size"]),
        n_groups=int(raw.get("n_groups", raw.get("mamba_n_groups", 8))),
        conv_kernel=int(raw.get("conv_kernel", raw.get("mamba_d_conv", 4))),
        chunk_size=int(raw.get("chunk_size", raw.get("mamba_chunk_size", 128))),
        time_step_min=float(raw.get("time_step_min", raw.get("mamba_dt_min", 0.001))),
        use_conv_bias=bool(raw.get("use_conv_bias", raw.get("mamba_conv_bias", True))),
        use_bias=bool(raw.get("use_bias", False)),
        norm_eps=eps,
    )
    if mamba.conv_kernel < 2 or mamba.num_heads % mamba.n_groups:
        raise ValueError("Nemotron-H needs conv_kernel >= 2 and mamba_num_heads divisible by n_groups")
    moe = moe_config_of(raw) if "moe" in layer_types else None
    return NemotronHConfig(text, layer_types, mamba, bool(raw.get("mlp_bias", False)), moe)
