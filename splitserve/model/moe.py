"""The sparse mixture-of-experts MLP of Qwen3-MoE and Qwen2-MoE, and the router and
experts of Nemotron-H's MoE layers: a router picks each token's top-k experts, and the
experts run grouped: the (token, expert) pairs are sorted by expert id so that every
active expert is one matmul over all of its tokens (no loop over tokens). Qwen2-MoE adds
a shared expert, a dense MLP every token goes through, scaled by a sigmoid gate of its
own: `sigmoid(shared_expert_gate(x)) * shared_expert(x)`, added to the routed experts' sum.
Nemotron-H's experts are not gated (up, ReLU², down: `NonGatedExperts`) and its router
scores with a sigmoid over groups of experts (`route_grouped_sigmoid`); its layer itself
is assembled in nemotron_h.py.

The split between the router (`SparseMoeBlock.gate`) and the rest (`ExpertsCompute`: the
routed experts and the shared one, `ExpertLayer` on an FFN daemon) is the seam of
attention-FFN disaggregation: the router stays with attention, the experts may run in
another process (splitserve/afd/).

Numerics follow transformers (Qwen3MoeTopKRouter, Qwen3MoeExperts, Qwen2MoeSparseMoeBlock,
NemotronHTopkRouter, NemotronHExperts): softmax in float32, top-k, optional
renormalization, weights cast back to the model dtype (Nemotron-H's stay float32); each
expert's output is scaled by its weight and summed into the token in expert-id order;
the shared expert's gated output is added last.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.model import ops
from splitserve.model.decoder_config import DecoderConfig, MoeConfig
from splitserve.model.linear import Linear
from splitserve.model.loader import iter_safetensors
from splitserve.model.materialize import materialize

# one expert's projection in the per-expert layout save_pretrained writes (`mlp.experts`
# in Qwen-MoE, `mixer.experts` in Nemotron-H)
EXPERT_WEIGHT = re.compile(
    r"^(layers\.\d+\.(?:mlp|mixer)\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
# any expert weight, per-expert or fused (`...mlp.experts.gate_up_proj`), or the shared
# expert's or its gate's (`...mlp.shared_expert.*`, `...mlp.shared_expert_gate.*`)
ANY_EXPERT_WEIGHT = re.compile(r"(^|\.)layers\.\d+\.mlp\.(experts\.|shared_expert\.|shared_expert_gate\.)")


def is_expert_weight(name: str) -> bool:
    """Whether a checkpoint tensor is an expert's, routed or shared (what an FFN daemon
    loads, and an attention engine does not)."""
    return ANY_EXPERT_WEIGHT.search(name) is not None


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def route_grouped_sigmoid(
    router_logits: torch.Tensor,  # [T, E] float32
    score_correction_bias: torch.Tensor,  # [E] float32: added to the scores to choose, not to weigh
    num_groups: int,
    top_groups: int,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nemotron-H's router (transformers' NemotronHTopkRouter, DeepSeek-V3's): sigmoid
    scores; the experts come in `num_groups` groups, each scored by the sum of its two best
    biased scores, and a token's top-k experts are chosen among the `top_groups` best
    groups only; their weights are the unbiased scores (renormalized when
    `norm_topk_prob`) times `routed_scaling_factor`. -> (weights [T, k] float32, ids [T, k])."""
    num_experts = router_logits.shape[-1]
    scores = router_logits.sigmoid()
    scores_for_choice = scores + score_correction_bias
    group_scores = (
        scores_for_choice.view(-1, num_groups, num_experts // num_groups).topk(2, dim=-1)[0].sum(dim=-1)
    )
    group_idx = torch.topk(group_scores, k=top_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1).expand(-1, num_groups, num_experts // num_groups).reshape(-1, num_experts)
    )
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(scores_for_choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def grouped_experts(
    x: torch.Tensor,  # [T, H]
    expert_ids: torch.Tensor,  # [T, k]
    expert_weights: torch.Tensor,  # [T, k]
    in_proj: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows; not gated: [E, I, H], up rows
    down_proj: torch.Tensor,  # [E, H, I]
    activation: Callable[[torch.Tensor], torch.Tensor] = ops.silu_and_mul,  # in_proj's output -> [rows, I]
) -> torch.Tensor:
    """sum_j weight[t, j] * expert_{id[t, j]}(x[t]) for every token t: [T, H], where an
    expert is down(activation(in_proj(x)))."""
    top_k = expert_ids.shape[1]
    flat_ids = expert_ids.reshape(-1)
    # stable: within an expert, pairs keep token order; per token, experts come in id order
    order = torch.argsort(flat_ids, stable=True)
    token_of_pair = order // top_k
    counts = torch.bincount(flat_ids, minlength=in_proj.shape[0]).tolist()
    inputs = x[token_of_pair]
    outputs = torch.empty_like(inputs)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        hidden = activation(F.linear(inputs[rows], in_proj[expert]))
        outputs[rows] = F.linear(hidden, down_proj[expert])
        start += count
    outputs *= expert_weights.reshape(-1)[order].unsqueeze(-1)
    combined = torch.zeros_like(x)
    return combined.index_add_(0, token_of_pair, outputs)


class ExpertsCompute(Protocol):
    """What computes a sparse layer's experts (routed and shared) from the router's
    choice: the local modules, or a remote FFN."""

    def __call__(
        self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor: ...


class Experts(nn.Module):
    """One sparse layer's experts, fused as transformers 5 holds them in memory."""

    def __init__(self, config: DecoderConfig, moe: MoeConfig) -> None:
        super().__init__()
        inter = moe.moe_intermediate_size
        self.intermediate = inter
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * inter, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, config.hidden_size, inter))

    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        return grouped_experts(x, expert_ids, expert_weights, self.gate_up_proj, self.down_proj)

    def expert_weight_view(self, expert: int, projection: str) -> tuple[str, torch.Tensor]:
        """(the fused parameter's name, the view of it) that one expert's `gate_proj`,
        `up_proj` or `down_proj` weight fills."""
        check_expert_index(expert, self.gate_up_proj.shape[0])
        if projection == "down_proj":
            return "down_proj", self.down_proj[expert]
        start = 0 if projection == "gate_proj" else self.intermediate
        return "gate_up_proj", self.gate_up_proj[expert].narrow(0, start, self.intermediate)


class NonGatedExperts(nn.Module):
    """One layer's experts of the form down(activation(up(x))) (Nemotron-H's, ReLU²), fused
    as transformers holds them: `up_proj` [E, I, W], `down_proj` [E, W, I], W the width
    they read and write (the hidden size, or the layer's latent size)."""

    def __init__(
        self,
        num_experts: int,
        width: int,
        intermediate: int,
        activation: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, width))
        self.down_proj = nn.Parameter(torch.empty(num_experts, width, intermediate))
        self.activation = activation

    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        return grouped_experts(x, expert_ids, expert_weights, self.up_proj, self.down_proj, self.activation)

    def expert_weight_view(self, expert: int, projection: str) -> tuple[str, torch.Tensor]:
        """(the fused parameter's name, the view of it) that one expert's `up_proj` or
        `down_proj` weight fills."""
        check_expert_index(expert, self.up_proj.shape[0])
        if projection == "gate_proj":
            raise ValueError("these experts are not gated: they have no gate_proj")
        return projection, getattr(self, projection)[expert]


def check_expert_index(expert: int, num_experts: int) -> None:
    if not 0 <= expert < num_experts:
        raise ValueError(f"expert {expert} out of range (the model has {num_experts})")


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a SiLU-gated MLP of its own width, weights as
    transformers names them (unfused: the loaders fill them by name)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def experts_output(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    experts: Experts,
    shared_expert: SharedExpert | None,
    shared_expert_gate: Linear | None,
) -> torch.Tensor:
    """The routed experts' weighted sum, plus the gated shared expert where there is one:
    the one computation a collocated layer and an FFN daemon both run."""
    routed = experts(x, expert_ids, expert_weights)
    if shared_expert is None or shared_expert_gate is None:
        return routed
    return routed + torch.sigmoid(shared_expert_gate(x)) * shared_expert(x)


def shared_expert_modules(config: DecoderConfig, moe: MoeConfig) -> tuple[SharedExpert | None, Linear | None]:
    """A layer's shared expert and its gate, or (None, None) for a model without one."""
    if moe.shared_expert_intermediate_size <= 0:
        return None, None
    shared = SharedExpert(config.hidden_size, moe.shared_expert_intermediate_size)
    return shared, Linear(config.hidden_size, 1, bias=False)


class ExpertLayer(nn.Module):
    """What an FFN daemon holds of one sparse layer: its experts and (Qwen2-MoE) shared
    expert, under the names the checkpoint gives them below `layers.i.mlp`."""

    def __init__(self, config: DecoderConfig, moe: MoeConfig) -> None:
        super().__init__()
        self.experts = Experts(config, moe)
        self.shared_expert, self.shared_expert_gate = shared_expert_modules(config, moe)

    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        return experts_output(
            x, expert_ids, expert_weights, self.experts, self.shared_expert, self.shared_expert_gate
        )


class SparseMoeBlock(nn.Module):
    """The router (`gate`, as transformers names it), the experts it picks and, for
    Qwen2-MoE, the shared expert (with `shared_expert_gate`)."""

    def __init__(self, config: DecoderConfig, moe: MoeConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = Linear(config.hidden_size, moe.num_experts, bias=False)
        self.experts: Experts | None = Experts(config, moe)  # None: an attention engine's
        self.shared_expert: SharedExpert | None
        self.shared_expert_gate: Linear | None
        self.shared_expert, self.shared_expert_gate = shared_expert_modules(config, moe)
        # set under attention-FFN disaggregation: the experts (shared too) run in the FFN process
        self.remote_experts: ExpertsCompute | None = None

    def drop_experts(self) -> None:
        """An attention engine's layer: its experts, shared ones too, are the daemon's."""
        self.experts = self.shared_expert = self.shared_expert_gate = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's (weights [T, k], expert ids [T, k]) for these tokens: what a remote
        FFN needs beside them (afd/microbatch.py sends them without waiting)."""
        return route(self.gate(x), self.top_k, self.norm_topk_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.remote_experts is not None:
            return self.remote_experts(x, ids, weights)
        assert self.experts is not None, "an attention engine's sparse layer has no remote experts"
        return experts_output(x, ids, weights, self.experts, self.shared_expert, self.shared_expert_gate)


def expert_weight_destination(modules: dict[str, nn.Module], name: str) -> tuple[str, torch.Tensor] | None:
    """(parameter name, the view one per-expert checkpoint tensor fills), or None when
    `name` (without the "model." prefix) is not a per-expert weight."""
    match = EXPERT_WEIGHT.match(name)
    if match is None:
        return None
    experts_path, expert, projection = match.group(1), int(match.group(2)), match.group(3)
    experts = modules.get(experts_path)
    if not isinstance(experts, Experts | NonGatedExperts):
        raise ValueError(f"unexpected weight {name!r}: layer has no experts")
    param_name, view = experts.expert_weight_view(expert, projection)
    return f"{experts_path}.{param_name}", view


def load_experts(
    model_dir: str, config: DecoderConfig, dtype: torch.dtype, device: torch.device
) -> dict[int, ExpertLayer]:
    """Only the experts (routed and shared), by layer (an FFN daemon's model): no other
    tensor is read. ValueError for a model without experts, unknown names, wrong shapes,
    missing ones."""
    moe = config.moe
    if moe is None:
        raise ValueError(f"{model_dir} is not a mixture-of-experts model ({config.arch})")
    with torch.device("meta"):
        layers = {i: ExpertLayer(config, moe) for i in range(config.num_layers) if moe.is_sparse_layer(i)}
    layers = {i: materialize(layer, device).to(dtype).eval() for i, layer in layers.items()}
    modules: dict[str, nn.Module] = {
        f"layers.{i}.mlp.{name}": module
        for i, layer in layers.items()
        for name, module in layer.named_modules()
        if name
    }
    params = {
        f"layers.{i}.mlp.{name}": p for i, layer in layers.items() for name, p in layer.named_parameters()
    }
    loaded = dict.fromkeys(params, 0)
    for name, tensor in iter_safetensors(model_dir, keep=is_expert_weight):
        target = name.removeprefix("model.")
        found = expert_weight_destination(modules, target)
        if found is None and target not in params:
            raise ValueError(f"unexpected expert weight {name!r}")
        target, destination = found if found is not None else (target, params[target])
        if destination.shape != tensor.shape:
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}"
            )
        with torch.no_grad():
            destination.copy_(tensor)
        loaded[target] += destination.numel()
    missing = [n for n, p in params.items() if loaded[n] < p.numel()]
    if missing:
        raise ValueError(f"checkpoint lacks expert weights for {missing[:5]}")
    for layer in layers.values():
        for module in layer.modules():
            if isinstance(module, Linear):
                module.prepack()
    return layers
