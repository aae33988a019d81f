"""The mixture-of-experts part of a tiny Qwen3-MoE or Qwen2-MoE (`splitserve tiny-model
--arch qwen3_moe|qwen2_moe`): its config.json fields and the random weights of a sparse
layer, in the per-expert layout transformers' `save_pretrained` writes; Qwen2-MoE's
layers have a shared expert too."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TinyMoeSpec:
    experts: int = 8
    experts_per_token: int = 2
    intermediate: int | None = None  # each expert's; default: hidden
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_intermediate: int | None = None  # qwen2_moe's shared expert's width; default: 2 * hidden

    def is_sparse_layer(self, layer_idx: int) -> bool:
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0

    def check(self) -> None:
        if not 0 < self.experts_per_token <= self.experts:
            raise ValueError("experts-per-token must be between 1 and the number of experts")
        if self.decoder_sparse_step < 1 or (self.intermediate is not None and self.intermediate < 1):
            raise ValueError("decoder_sparse_step and the expert intermediate size must be positive")


def shared_width(moe: TinyMoeSpec, arch: str, hidden: int) -> int:
    """The shared expert's intermediate size (0: none; only qwen2_moe has one)."""
    return (moe.shared_intermediate or 2 * hidden) if arch == "qwen2_moe" else 0


def moe_config_fields(moe: TinyMoeSpec, hidden: int, arch: str = "qwen3_moe") -> dict:
    shared = (
        {"shared_expert_intermediate_size": shared_width(moe, arch, hidden)} if arch == "qwen2_moe" else {}
    )
    return {
        **shared,
        "num_experts": moe.experts,
        "num_experts_per_tok": moe.experts_per_token,
        "moe_intermediate_size": moe.intermediate or hidden,
        "norm_topk_prob": moe.norm_topk_prob,
        "decoder_sparse_step": moe.decoder_sparse_step,
        "mlp_only_layers": list(moe.mlp_only_layers),
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
    }


def sparse_layer_weights(
    moe: TinyMoeSpec,
    prefix: str,
    hidden: int,
    linear: Callable[[int, int], np.ndarray],
    shared: int = 0,  # the shared expert's width (0: none)
) -> dict[str, np.ndarray]:
    """The router (`mlp.gate`), every expert's gate/up/down projection of one layer and,
    with `shared`, the shared expert's and its gate. The router's logits are spread (x2)
    so that top-k choices have clear gaps."""
    inter = moe.intermediate or hidden
    weights = {prefix + "mlp.gate.weight": linear(moe.experts, hidden) * 2.0}
    for e in range(moe.experts):
        weights[prefix + f"mlp.experts.{e}.gate_proj.weight"] = linear(inter, hidden)
        weights[prefix + f"mlp.experts.{e}.up_proj.weight"] = linear(inter, hidden)
        weights[prefix + f"mlp.experts.{e}.down_proj.weight"] = linear(hidden, inter)
    if shared:
        weights[prefix + "mlp.shared_expert.gate_proj.weight"] = linear(shared, hidden)
        weights[prefix + "mlp.shared_expert.up_proj.weight"] = linear(shared, hidden)
        weights[prefix + "mlp.shared_expert.down_proj.weight"] = linear(hidden, shared)
        weights[prefix + "mlp.shared_expert_gate.weight"] = linear(1, hidden)
    return weights
