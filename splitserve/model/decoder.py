"""One decoder for Llama, Qwen2 (QKV bias), Qwen3 (per-head q/k RMSNorm) and Qwen3-MoE
(Qwen3 whose sparse layers' MLP is a mixture of experts, moe.py).

Q, K, V projections are fused into one matmul, gate and up into another; a layer is
nine ops (two fused add+RMSNorms, three matmuls plus o_proj, RoPE+cache write, attention,
SiLU*up, see ops.py). Numerics follow transformers (RMSNorm in float32, RoPE tables cast
to the model dtype) so that greedy outputs match its `generate` exactly in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from splitserve.model import ops
from splitserve.model.attention import AttentionMetadata, paged_attention
from splitserve.model.compiled_layers import (
    LayerParts,
    LayersPlan,
    LayersShape,
    plan_layers,
    run_compiled_layers,
)
from splitserve.model.decoder_config import DecoderConfig
from splitserve.model.linear import GEMV_MAX_ROWS, Linear
from splitserve.model.loader import iter_checkpoint_weights, iter_safetensors
from splitserve.model.materialize import materialize
from splitserve.model.moe import SparseMoeBlock, expert_weight_destination, is_expert_weight
from splitserve.model.native import use_cpu_ops
from splitserve.model.quant_linear import (
    MixedQuantLinear,
    QuantizedTensor,
    QuantLayout,
    QuantLinear,
    replace_with_quant_linears,
)

QUANT_LINEARS = (QuantLinear, MixedQuantLinear)  # what load_weights fills with blocks

# Called after layer i's KV is written: (layer_idx, kv_layer) -> None.
LayerHook = Callable[[int, torch.Tensor], None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(config: DecoderConfig) -> torch.Tensor:
    dim = config.head_dim
    # On the CPU even where a model is built on the meta device: meta math runs through
    # torch's reference ops, whose first use imports torch._dynamo (seconds of every start).
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling_dict
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = self.head_dim**-0.5
        self._qk_norm_weight: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        has_qk_norm = self.q_norm is not None
        ops.rope_and_cache(
            qkv,
            cos,
            sin,
            self.qk_norm_weight() if has_qk_norm else None,
            self.q_norm.eps if self.q_norm is not None else 0.0,
            kv_layer,
            meta.slot_mapping,
            self.num_heads,
            self.num_kv_heads,
        )
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        out = paged_attention(q, kv_layer, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def qk_norm_weight(self) -> torch.Tensor:
        """q_norm's weight for every query head, then k_norm's for every KV head."""
        if self._qk_norm_weight is None:
            assert self.q_norm is not None and self.k_norm is not None
            self._qk_norm_weight = torch.cat(
                [
                    self.q_norm.weight.detach().expand(self.num_heads, -1),
                    self.k_norm.weight.detach().expand(self.num_kv_heads, -1),
                ]
            )
        return self._qk_norm_weight


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.moe
        self.mlp: MLP | SparseMoeBlock = (
            SparseMoeBlock(config, moe) if moe is not None and moe.is_sparse_layer(layer_idx) else MLP(config)
        )


class DecoderModel(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        # No random init (the checkpoint fills the weight): on the meta device it would run
        # through torch's reference ops, as rope_inv_freq explains.
        weight = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.rope_cos = self.rope_sin = torch.empty(0)
        # per (activation dtype, at most GEMV_MAX_ROWS tokens): the compiled layers' fixed
        # arguments (None: the op does not apply), made on first use after a load
        self.layer_plans: dict[tuple[torch.dtype, bool], LayersPlan | None] = {}

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] (the same for every head), from a table grown on demand."""
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if self.rope_cos.shape[0] < needed or self.rope_cos.dtype != dtype:
            length = max(needed, 2 * self.rope_cos.shape[0], 1024)
            table = torch.arange(length, device=self.inv_freq.device).float()[:, None] * self.inv_freq.float()
            emb = torch.cat((table, table), dim=-1)
            half = emb.shape[-1] // 2
            # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]: one op fewer per step
            sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(emb.device)
            self.rope_cos, self.rope_sin = emb.cos().to(dtype), (emb.sin().to(dtype) * sign.to(dtype))
        return self.rope_cos[positions], self.rope_sin[positions]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # rows whose next token is sampled
        before_layer: Callable[[int], None] | None = None,
        after_layer: LayerHook | None = None,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: replaces embed_tokens(input_ids)
    ) -> torch.Tensor:
        """Returns logits [len(logits_indices), vocab] in the model dtype (the sampler
        widens them to float32 where it needs more than an argmax). `positions` is [T], or
        [3, T] for a model whose rope() takes M-RoPE positions (Qwen2-VL)."""
        # the residual stream, updated in place (inputs_embeds is the step's own tensor)
        residual = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rope(positions, residual.dtype)
        normed = self.layers[0].input_layernorm(residual)
        hooked = before_layer is not None or after_layer is not None
        plan = None if hooked else self.compiled_plan(residual, positions, kv_cache, meta)
        if plan is not None:
            shape = self.layers_shape()
            mlp_out = run_compiled_layers(plan, shape, residual, normed, kv_cache, cos, sin, meta)
        else:
            mlp_out = self.layers_module_by_module(
                residual, normed, cos, sin, kv_cache, meta, before_layer, after_layer
            )
        # only the sampled rows go through the last residual add, the norm and the head
        last = ops.add_rms_norm(
            residual[logits_indices], mlp_out[logits_indices], self.norm.weight, self.norm.eps
        )
        return self.lm_head(last)

    def layers_module_by_module(
        self,
        residual: torch.Tensor,
        normed: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        before_layer: Callable[[int], None] | None,
        after_layer: LayerHook | None,
    ) -> torch.Tensor:
        """Every layer, module by module; the last layer's MLP output (not yet added into
        the residual, which is updated in place)."""
        for i, layer in enumerate(self.layers):
            if before_layer is not None:
                before_layer(i)
            attn_out = layer.self_attn(normed, cos, sin, kv_cache[i], meta)
            if after_layer is not None:
                after_layer(i, kv_cache[i])
            post_norm = layer.post_attention_layernorm
            mlp_out = layer.mlp(ops.add_rms_norm(residual, attn_out, post_norm.weight, post_norm.eps))
            if i + 1 < len(self.layers):
                next_norm = self.layers[i + 1].input_layernorm
                normed = ops.add_rms_norm(residual, mlp_out, next_norm.weight, next_norm.eps)
        return mlp_out

    def compiled_plan(
        self, residual: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> LayersPlan | None:
        """The compiled layers' plan where this step can take it: one row of positions,
        compiled kernels, every layer dense with a kernel for each matmul, and each prefill
        chunk's attention the compiled bf16 kernel (as ops.prefill_attention decides)."""
        if positions.dim() != 1 or not isinstance(kv_cache, torch.Tensor) or not use_cpu_ops(residual):
            return None
        dtype = residual.dtype
        if meta.prefills and not (
            dtype == torch.bfloat16 and ops.bf16_prefill_kernel_supports(self.config.head_dim)
        ):
            return None
        key = (dtype, residual.shape[0] <= GEMV_MAX_ROWS)
        if key not in self.layer_plans:
            parts = self.layer_parts()
            self.layer_plans[key] = None if parts is None else plan_layers(parts, *key)
        return self.layer_plans[key]

    def layer_parts(self) -> list[LayerParts] | None:
        """Each layer's parts for the compiled layers; None where a layer is not plain
        attention + MLP or the norms differ in eps (the op takes one)."""
        layers = list(self.layers)
        if not all(type(layer.self_attn) is Attention and type(layer.mlp) is MLP for layer in layers):
            return None
        norms = [layer.post_attention_layernorm for layer in layers]
        norms += [layer.input_layernorm for layer in layers]
        if len({norm.eps for norm in norms}) != 1:
            return None
        parts = []
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            assert isinstance(attn, Attention) and isinstance(mlp, MLP)
            if attn.q_norm is not None and attn.k_norm is not None and attn.q_norm.eps != attn.k_norm.eps:
                return None
            next_norm = layers[i + 1].input_layernorm.weight.detach() if i + 1 < len(layers) else None
            parts.append(
                LayerParts(
                    attn.qkv_proj,
                    attn.qk_norm_weight() if attn.q_norm is not None else None,
                    attn.o_proj,
                    layer.post_attention_layernorm.weight.detach(),
                    mlp.gate_up_proj,
                    mlp.down_proj,
                    next_norm,
                )
            )
        return parts

    def layers_shape(self) -> LayersShape:
        attn = self.layers[0].self_attn
        q_norm = attn.q_norm
        return LayersShape(
            attn.num_heads,
            attn.num_kv_heads,
            self.layers[0].post_attention_layernorm.eps,
            q_norm.eps if q_norm is not None else 0.0,
            attn.scale,
        )

    def prepare_for_inference(self) -> None:
        """After the weights are loaded (from any format): prepack the matmul weights."""
        self.layer_plans.clear()
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        """Fill from HF tensor names (streamed, shard by shard), fusing q/k/v and gate/up
        (and each expert's into its layer's fused expert tensors; a QuantizedTensor into
        its QuantLinear's rows). Raises ValueError for unknown names, wrong shapes and
        missing weights."""
        self.layer_plans.clear()
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        fused = {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, c.intermediate_size),
            "up_proj": ("gate_up_proj", c.intermediate_size, c.intermediate_size),
        }
        elements_loaded = dict.fromkeys(params, 0)
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            target, start, size = name.removeprefix("model."), 0, None
            expert = expert_weight_destination(modules, target)
            if expert is not None:
                target, destination = expert
            else:
                for part, (fused_name, offset, length) in fused.items():
                    # a name that is a parameter itself is not fused (a Qwen2-MoE shared
                    # expert keeps its gate_proj and up_proj)
                    if f".{part}." in target and target not in params:
                        target, start, size = target.replace(part, fused_name), offset, length
                        break
                if isinstance(tensor, QuantizedTensor):
                    module = modules.get(target.removesuffix(".weight"))
                    fits = (
                        isinstance(module, QUANT_LINEARS) and start + tensor.shape[0] <= module.out_features
                    )
                    if not fits:
                        raise ValueError(f"unexpected quantized weight {name!r}")
                    module.load_rows(start, tensor)
                    continue
                if target not in params:
                    raise ValueError(f"unexpected weight {name!r}")
                destination = params[target] if size is None else params[target].narrow(0, start, size)
            if destination.shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}"
                )
            with torch.no_grad():
                destination.copy_(tensor)
            elements_loaded[target] += destination.numel()
        if isinstance(self.lm_head, Linear) and (
            c.tie_word_embeddings or elements_loaded["lm_head.weight"] == 0
        ):
            self.lm_head.weight = self.embed_tokens.weight
            elements_loaded["lm_head.weight"] = self.lm_head.weight.numel()
        missing = [n for n, p in params.items() if elements_loaded[n] < p.numel()]
        missing += [
            n for n, m in modules.items() if isinstance(m, QUANT_LINEARS) and m.rows_loaded < m.out_features
        ]
        if missing:
            raise ValueError(f"checkpoint lacks weights for {missing[:5]}")


def load_model(
    model_dir: str,
    config: DecoderConfig,
    dtype: torch.dtype,
    device: torch.device,
    with_experts: bool = True,  # False: a MoE model's experts run elsewhere (an FFN daemon)
    quantized: Mapping[str, QuantLayout] | None = None,  # Linears kept in a GGUF block format
) -> DecoderModel:
    with torch.device("meta"):
        model = DecoderModel(config)
        replace_with_quant_linears(model, quantized or {})
    weights = iter_checkpoint_weights(model_dir, tuple(quantized or ()))
    if not with_experts:
        for layer in model.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.drop_experts()
        weights = iter_safetensors(model_dir, keep=lambda name: not is_expert_weight(name))
    model = materialize(model, device).to(dtype)
    model.inv_freq = rope_inv_freq(config).to(device)
    model.rope_cos = model.rope_sin = torch.empty(0, device=device)
    model.load_weights(weights)
    return model.eval()
