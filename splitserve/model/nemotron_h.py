"""Nemotron-H (`NemotronHForCausalLM`): Mamba2, attention and MLP layers interleaved.

Each layer is one mixer behind an RMSNorm with a residual add; `hybrid_override_pattern`
(or transformers 5's `layers_block_type`) says which: `M` Mamba2 (mamba2.py), `*` attention
(no positional embedding: the Mamba layers carry order), `-` an MLP (up, ReLU², down), `E`
a mixture of experts (`MoE`: moe.py's grouped experts behind a sigmoid router, plus a
shared expert). Only the attention layers have KV: the engine's paged cache holds one KV
layer per `*`, and the Mamba layers' state lives in per-request slots
(splitserve/engine/state_pool.py). Multi-token-prediction heads are not supported.

Numerics follow transformers (RMSNorm weight multiplied in float32, logits in the model
dtype) so that float32 greedy outputs match its `generate`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.model import ops
from splitserve.model.attention import AttentionMetadata, paged_attention
from splitserve.model.decoder_config import DecoderConfig
from splitserve.model.linear import Linear
from splitserve.model.loader import iter_safetensors
from splitserve.model.mamba2 import Mamba2Mixer, MambaMetadata
from splitserve.model.materialize import materialize
from splitserve.model.moe import NonGatedExperts, expert_weight_destination, route_grouped_sigmoid
from splitserve.model.nemotron_h_config import PATTERN_LAYERS, NemotronHConfig, NemotronHMoeConfig

# Called after attention layer i's KV is written: (kv_layer_idx, kv_layer) -> None.
KVLayerHook = Callable[[int, torch.Tensor], None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' NemotronHRMSNorm: the weight multiplied in float32, then cast."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Paged attention without rotary embedding; q, k and v fused into one matmul."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        kv_shape = (-1, self.num_kv_heads, self.head_dim)
        # rounded to the cache's dtype (16-bit under float32 activations, --kv-cache-dtype)
        kv_layer[0].view(kv_shape).index_copy_(0, meta.slot_mapping, k.reshape(kv_shape).to(kv_layer.dtype))
        kv_layer[1].view(kv_shape).index_copy_(0, meta.slot_mapping, v.reshape(kv_shape).to(kv_layer.dtype))
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        out = paged_attention(q, kv_layer, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.relu_squared(self.up_proj(x)))


class TopkRouter(nn.Module):
    """transformers' NemotronHTopkRouter: its weight and score bias stay float32 whatever
    the model's dtype (transformers keeps them so), and the logits are float32."""

    def __init__(self, hidden: int, moe: NemotronHMoeConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k])."""
        moe = self.moe
        logits = F.linear(x.float(), self.weight.float())
        return route_grouped_sigmoid(
            logits,
            self.e_score_correction_bias.float(),
            moe.num_groups,
            moe.top_groups,
            moe.top_k,
            moe.norm_topk_prob,
            moe.routed_scaling_factor,
        )


class MoE(nn.Module):
    """transformers' NemotronHMoE: the routed experts' weighted sum (computed in the latent
    width when the layer has `fc1_latent_proj`/`fc2_latent_proj`) plus the shared expert
    on the layer's input. Names as the checkpoint's, below `layers.i.mixer`."""

    def __init__(self, hidden: int, moe: NemotronHMoeConfig, mlp_bias: bool) -> None:
        super().__init__()
        self.gate = TopkRouter(hidden, moe)
        width = moe.latent_size or hidden
        self.experts = NonGatedExperts(moe.num_experts, width, moe.intermediate_size, ops.relu_squared)
        self.shared_experts = MLP(hidden, moe.shared_intermediate_size, mlp_bias)
        self.fc1_latent_proj: Linear | None = None
        self.fc2_latent_proj: Linear | None = None
        if moe.latent_size is not None:
            self.fc1_latent_proj = Linear(hidden, moe.latent_size, bias=mlp_bias)
            self.fc2_latent_proj = Linear(moe.latent_size, hidden, bias=mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        routed_input = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        routed = self.experts(routed_input, ids, weights)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(x)

    def keep_router_in_float32(self) -> None:
        self.gate.float()


class Block(nn.Module):
    def __init__(self, config: NemotronHConfig, kind: str, kind_index: int) -> None:
        super().__init__()
        c = config.text
        self.kind = kind
        self.kind_index = kind_index  # its index among the layers of its kind (KV layer, state layer)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mixer: nn.Module
        if kind == "mamba":
            self.mixer = Mamba2Mixer(c.hidden_size, config.mamba, kind_index)
        elif kind == "attention":
            self.mixer = Attention(c)
        elif kind == "moe":
            assert config.moe is not None, "a Nemotron-H config with MoE layers carries their shape"
            self.mixer = MoE(c.hidden_size, config.moe, config.mlp_bias)
        else:
            self.mixer = MLP(c.hidden_size, c.intermediate_size, config.mlp_bias)


class NemotronHModel(nn.Module):
    def __init__(self, config: NemotronHConfig) -> None:
        super().__init__()
        self.config = config
        c = config.text
        weight = torch.empty(c.vocab_size, c.hidden_size)  # no random init (see decoder.py)
        self.embeddings = nn.Embedding(c.vocab_size, c.hidden_size, _weight=weight)
        counts = dict.fromkeys(PATTERN_LAYERS.values(), 0)
        blocks = []
        for kind in config.layer_types:
            blocks.append(Block(config, kind, counts[kind]))
            counts[kind] += 1
        self.layers = nn.ModuleList(blocks)
        self.norm_f = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T] (unused: no positional embedding)
        kv_cache: torch.Tensor,  # [attention layers, 2, blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        before_layer: Callable[[int], None] | None = None,
        after_layer: KVLayerHook | None = None,
        inputs_embeds: torch.Tensor | None = None,
        mamba: MambaMetadata | None = None,
    ) -> torch.Tensor:
        """Logits [len(logits_indices), vocab]; the hooks see KV layer indexes."""
        if mamba is None:
            raise ValueError("a Nemotron-H step needs its Mamba state metadata")
        hidden = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        for block in self.layers:
            normed = block.norm(hidden)
            if block.kind == "mamba":
                out = block.mixer(normed, mamba)
            elif block.kind == "attention":
                if before_layer is not None:
                    before_layer(block.kind_index)
                out = block.mixer(normed, kv_cache[block.kind_index], meta)
                if after_layer is not None:
                    after_layer(block.kind_index, kv_cache[block.kind_index])
            else:
                out = block.mixer(normed)
            hidden = hidden + out
        return self.lm_head(self.norm_f(hidden[logits_indices]))

    def prepare_for_inference(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill from HF names (`model.*` or NVIDIA's `backbone.*`), fusing q/k/v and each
        MoE layer's per-expert weights (`mixer.experts.{e}.up_proj.weight`, as the Hub
        files and transformers' save_pretrained write them; transformers' fused
        `mixer.experts.up_proj` loads as it is). Raises ValueError for unknown names,
        wrong shapes and missing weights."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        c = self.config.text
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        fused = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}
        loaded = dict.fromkeys(params, 0)  # elements filled
        for name, tensor in weights:
            target = name.removeprefix("model.").removeprefix("backbone.")
            if target.startswith("mtp."):
                continue  # multi-token prediction heads: not used
            expert = expert_weight_destination(modules, target)
            start, size = 0, None
            for part, (offset, length) in fused.items():
                if expert is None and f".{part}." in target:
                    target, start, size = target.replace(part, "qkv_proj"), offset, length
                    break
            if expert is not None:
                target, destination = expert
            elif target not in params:
                raise ValueError(f"unexpected weight {name!r}")
            else:
                destination = params[target] if size is None else params[target].narrow(0, start, size)
            if destination.shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}"
                )
            with torch.no_grad():
                destination.copy_(tensor)
            loaded[target] += destination.numel()
        if c.tie_word_embeddings or loaded["lm_head.weight"] == 0:
            self.lm_head.weight = self.embeddings.weight
            loaded["lm_head.weight"] = self.lm_head.weight.numel()
        missing = [n for n, p in params.items() if loaded[n] < p.numel()]
        if missing:
            raise ValueError(f"checkpoint lacks weights for {missing[:5]}")


def load_nemotron_h(
    model_dir: str, config: NemotronHConfig, dtype: torch.dtype, device: torch.device
) -> NemotronHModel:
    with torch.device("meta"):
        model = NemotronHModel(config)
    model = materialize(model, device).to(dtype)
    for module in model.modules():
        if isinstance(module, MoE):
            module.keep_router_in_float32()
    model.load_weights(iter_safetensors(model_dir))
    return model.eval()
