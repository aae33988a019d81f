"""The random-weight Nemotron-H that `splitserve tiny-model --arch nemotron_h` writes: the
text model's tokenizer and chat template (tiny_text.py) and a hybrid decoder whose layers
follow `pattern` (`M` Mamba2, `*` attention, `-` MLP, `E` mixture of experts), with
NVIDIA's config.json fields and, for `E` layers, the per-expert weight names NVIDIA's
checkpoints and transformers' save_pretrained write."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from splitserve.model.tiny_text import (
    MARKUP_TOKENS,
    SPECIAL_TOKENS,
    TinyModelSpec,
    build_tokenizer,
    chat_template,
    check_spec,
    write_generation_config,
    write_tokenizer,
)

DEFAULT_PATTERN = "M-M*-M-"
# the Mamba2 shape of the tiny model: 8 heads of 8 (intermediate 64), state 16, 2 groups;
# scan chunks of 8 tokens, so that short prompts already span several
MAMBA = {
    "mamba_num_heads": 8,
    "mamba_head_dim": 8,
    "ssm_state_size": 16,
    "n_groups": 2,
    "conv_kernel": 4,
    "chunk_size": 8,
}
TIME_STEP_MIN, TIME_STEP_MAX = 0.001, 0.1
# the MoE layers (E) of the tiny model: 8 experts of width hidden / 2 in 2 groups, each
# token's top 2 from the best group, a shared expert as wide as the hidden size; the
# router's scores are scaled up and its weights by 2.5 (as Nemotron-3-Nano's) so that
# the experts' choice and weight matter to the tokens
MOE = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "moe_latent_size": None,
}


def check_pattern(pattern: str) -> None:
    if not pattern or set(pattern) - set("M*-E"):
        raise ValueError(
            f"pattern {pattern!r} must be made of M (Mamba2), * (attention), - (MLP) and E (experts)"
        )
    if "*" not in pattern:
        raise ValueError("pattern needs at least one attention layer (*)")


def _config(spec: TinyModelSpec, pattern: str, eos_id: int, pad_id: int) -> dict:
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.resolved_intermediate,
        "num_hidden_layers": len(pattern),
        "hybrid_override_pattern": pattern,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.resolved_head_dim,
        "attention_bias": False,
        "mlp_bias": False,
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        **MAMBA,
        "expand": 2,
        "use_conv_bias": True,
        "use_bias": False,
        "time_step_min": TIME_STEP_MIN,
        "time_step_max": TIME_STEP_MAX,
        "layer_norm_epsilon": 1e-5,
        "max_position_embeddings": spec.max_position,
        "tie_word_embeddings": False,
        "bos_token_id": pad_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": spec.dtype,
        "use_cache": True,
        **(moe_config_fields(spec.hidden) if "E" in pattern else {}),
    }


def moe_config_fields(hidden: int) -> dict:
    return {**MOE, "moe_intermediate_size": hidden // 2, "moe_shared_expert_intermediate_size": hidden}


def random_weights(spec: TinyModelSpec, pattern: str) -> dict[str, np.ndarray]:
    """Random float32 weights, activations O(1); dt_bias drawn as transformers initializes
    it (softplus(dt_bias) log-uniform in [time_step_min, time_step_max])."""
    rng = np.random.default_rng(spec.seed)
    hidden, head_dim = spec.hidden, spec.resolved_head_dim
    q_dim, kv_dim, inter = spec.heads * head_dim, spec.kv_heads * head_dim, spec.resolved_intermediate
    heads = MAMBA["mamba_num_heads"]
    mamba_inter = heads * MAMBA["mamba_head_dim"]
    conv_dim = mamba_inter + 2 * MAMBA["n_groups"] * MAMBA["ssm_state_size"]

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return rng.standard_normal((out_dim, in_dim), dtype=np.float32) / np.sqrt(in_dim)

    def norm(dim: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    weights = {"model.embeddings.weight": rng.standard_normal((spec.vocab, hidden), dtype=np.float32)}
    for i, kind in enumerate(pattern):
        p = f"model.layers.{i}."
        weights[p + "norm.weight"] = norm(hidden)
        if kind == "M":
            dt = np.exp(
                rng.random(heads) * (np.log(TIME_STEP_MAX) - np.log(TIME_STEP_MIN)) + np.log(TIME_STEP_MIN)
            )
            weights[p + "mixer.in_proj.weight"] = linear(mamba_inter + conv_dim + heads, hidden)
            kernel = MAMBA["conv_kernel"]
            weights[p + "mixer.conv1d.weight"] = linear(conv_dim, kernel).reshape(conv_dim, 1, kernel)
            weights[p + "mixer.conv1d.bias"] = (0.1 * rng.standard_normal(conv_dim)).astype(np.float32)
            weights[p + "mixer.dt_bias"] = (dt + np.log(-np.expm1(-dt))).astype(np.float32)
            weights[p + "mixer.A_log"] = np.log(np.arange(1, heads + 1, dtype=np.float32))
            weights[p + "mixer.D"] = norm(heads)
            weights[p + "mixer.norm.weight"] = norm(mamba_inter)
            weights[p + "mixer.out_proj.weight"] = linear(hidden, mamba_inter)
        elif kind == "*":
            weights[p + "mixer.q_proj.weight"] = linear(q_dim, hidden)
            weights[p + "mixer.k_proj.weight"] = linear(kv_dim, hidden)
            weights[p + "mixer.v_proj.weight"] = linear(kv_dim, hidden)
            weights[p + "mixer.o_proj.weight"] = linear(hidden, q_dim)
        elif kind == "E":
            weights.update(moe_layer_weights(p + "mixer.", hidden, linear, rng))
        else:
            weights[p + "mixer.up_proj.weight"] = linear(inter, hidden)
            weights[p + "mixer.down_proj.weight"] = linear(hidden, inter) / 2
    weights["model.norm_f.weight"] = norm(hidden)
    weights["lm_head.weight"] = linear(spec.vocab, hidden) * 4.0
    return weights


def moe_layer_weights(
    prefix: str, hidden: int, linear: Callable[[int, int], np.ndarray], rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """An `E` layer's router (with a score correction bias that moves choices), its
    experts one by one, and its shared expert."""
    experts, inter = MOE["n_routed_experts"], hidden // 2
    weights = {
        prefix + "gate.weight": linear(experts, hidden) * 3.0,
        prefix + "gate.e_score_correction_bias": (0.2 * rng.standard_normal(experts)).astype(np.float32),
    }
    for e in range(experts):
        weights[prefix + f"experts.{e}.up_proj.weight"] = linear(inter, hidden)
        weights[prefix + f"experts.{e}.down_proj.weight"] = linear(hidden, inter) / 2
    weights[prefix + "shared_experts.up_proj.weight"] = linear(hidden, hidden)
    weights[prefix + "shared_experts.down_proj.weight"] = linear(hidden, hidden) / 2
    return weights


def write_tiny_nemotron_h(
    directory: str | os.PathLike[str], spec: TinyModelSpec, pattern: str = DEFAULT_PATTERN
) -> Path:
    """A Nemotron-H model directory with random weights."""
    import torch
    from safetensors.torch import save_file

    check_spec(spec)
    check_pattern(pattern)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab, spec.seed)
    eos_id = tokenizer.token_to_id("<|im_end|>")
    pad_id = tokenizer.token_to_id("<|endoftext|>")
    write_tokenizer(out, tokenizer, SPECIAL_TOKENS + MARKUP_TOKENS, chat_template(), spec.max_position)
    (out / "config.json").write_text(json.dumps(_config(spec, pattern, eos_id, pad_id), indent=2))
    write_generation_config(out, eos_id, pad_id)
    dtype = getattr(torch, spec.dtype)
    tensors = {
        name: torch.from_numpy(w).to(dtype).contiguous() for name, w in random_weights(spec, pattern).items()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
