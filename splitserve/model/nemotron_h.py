"""Nemotron-H (`NemotronHForCausalLM`): Mamba2, attention and MLP layers interleaved.

Each layer is one mixer behind an RMSNorm with a residual add; `hybrid_override_pattern`
(or transformers 5's `layers_block_type`) says which: `M` Mamba2 (mamba2.py), `*` attention
(no positional embedding: the Mamba layers carry order), `-` an MLP (up, ReLU², down).
Only the attention layers have KV: the engine's paged cache holds one KV layer per `*`,
and the Mamba layers' state lives in per-request slots (splitserve/engine/state_pool.py).
MoE layers (`E`) and multi-token-prediction heads are not supported.

Numerics follow transformers (RMSNorm weight multiplied in float32, logits in the model
dtype) so that float32 greedy outputs match its `generate`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.model.attention import AttentionMetadata, paged_attention
from splitserve.model.decoder_config import DecoderConfig
from splitserve.model.linear import Linear
from splitserve.model.loader import iter_safetensors
from splitserve.model.mamba2 import Mamba2Mixer, MambaMetadata, MambaShape

PATTERN_LAYERS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
BLOCK_TYPE_LAYERS = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}

# Called after attention layer i's KV is written: (kv_layer_idx, kv_layer) -> None.
KVLayerHook = Callable[[int, torch.Tensor], None]


@dataclass(frozen=True)
class NemotronHConfig:
    text: DecoderConfig  # vocabulary, attention shape; num_layers = attention layers (KV layers)
    layer_types: tuple[str, ...]  # "mamba" | "attention" | "mlp", one per layer
    mamba: MambaShape
    mlp_bias: bool

    @property
    def num_mamba_layers(self) -> int:
        return self.layer_types.count("mamba")


def _token_ids(value: object) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]  # type: ignore[union-attr]


def _layer_types(raw: dict) -> tuple[str, ...]:
    if raw.get("layers_block_type"):
        names = [BLOCK_TYPE_LAYERS.get(t) for t in raw["layers_block_type"]]
    else:
        names = [PATTERN_LAYERS.get(c) for c in raw.get("hybrid_override_pattern") or ""]
    if not names or None in names:
        raise ValueError("Nemotron-H config needs hybrid_override_pattern (M, *, -) or layers_block_type")
    if "moe" in names:
        raise ValueError("Nemotron-H MoE layers ('E') are not supported")
    if (raw.get("num_nextn_predict_layers") or 0) > 0:
        raise ValueError("Nemotron-H multi-token prediction layers are not supported")
    if raw.get("mlp_hidden_act", "relu2") != "relu2" or raw.get("mamba_hidden_act", "silu") != "silu":
        raise ValueError("Nemotron-H activations other than relu2 (MLP) and silu (Mamba) are not supported")
    return tuple(n for n in names if n is not None)


def load_nemotron_h_config(model_dir: str | Path) -> NemotronHConfig:
    """From config.json, with the field names of both NVIDIA's checkpoints and transformers 5."""
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    layer_types = _layer_types(raw)
    heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
    eps = float(raw.get("layer_norm_epsilon", 1e-5))
    eos = _token_ids(raw.get("eos_token_id"))
    generation_path = model_dir / "generation_config.json"
    if generation_path.is_file():
        generation = json.loads(generation_path.read_text())
        eos += [t for t in _token_ids(generation.get("eos_token_id")) if t not in eos]
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
    return NemotronHConfig(text, layer_types, mamba, bool(raw.get("mlp_bias", False)))


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
        kv_layer[0].view(kv_shape).index_copy_(0, meta.slot_mapping, k.reshape(kv_shape))
        kv_layer[1].view(kv_shape).index_copy_(0, meta.slot_mapping, v.reshape(kv_shape))
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        out = paged_attention(q, kv_layer, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))


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
        """Fill from HF names (`model.*` or NVIDIA's `backbone.*`), fusing q/k/v.
        Raises ValueError for unknown names, wrong shapes and missing weights."""
        params = dict(self.named_parameters())
        c = self.config.text
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        fused = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}
        rows_loaded = dict.fromkeys(params, 0)
        for name, tensor in weights:
            target = name.removeprefix("model.").removeprefix("backbone.")
            if target.startswith("mtp."):
                continue  # multi-token prediction heads: not used
            start, size = 0, None
            for part, (offset, length) in fused.items():
                if f".{part}." in target:
                    target, start, size = target.replace(part, "qkv_proj"), offset, length
                    break
            if target not in params:
                raise ValueError(f"unexpected weight {name!r}")
            destination = params[target] if size is None else params[target].narrow(0, start, size)
            if destination.shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}"
                )
            with torch.no_grad():
                destination.copy_(tensor)
            rows_loaded[target] += destination.shape[0]
        if c.tie_word_embeddings or rows_loaded["lm_head.weight"] == 0:
            self.lm_head.weight = self.embeddings.weight
            rows_loaded["lm_head.weight"] = c.vocab_size
        missing = [n for n, p in params.items() if rows_loaded[n] < p.shape[0]]
        if missing:
            raise ValueError(f"checkpoint lacks weights for {missing[:5]}")


def load_nemotron_h(
    model_dir: str, config: NemotronHConfig, dtype: torch.dtype, device: torch.device
) -> NemotronHModel:
    with torch.device("meta"):
        model = NemotronHModel(config)
    model = model.to_empty(device=device).to(dtype)
    model.load_weights(iter_safetensors(model_dir))
    return model.eval()
