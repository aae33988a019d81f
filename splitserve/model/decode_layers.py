"""A decode-only step of a dense decoder's layers in one compiled call
(csrc/decode_layers.cpp).

At batch 1 a layer's math is a few hundred microseconds of weight reads, and each of its
nine kernel calls costs ~10 us of Python (module calls, wrappers, checks, allocations):
a quarter of a SmolLM2-135M step. The op runs the same kernels in the same order on
buffers of the same shapes, so a step's outputs equal the Python path's bit for bit
(tests/model/test_decode_layers.py). It applies where every layer is plain attention +
MLP whose matmuls run a kernel the op calls for the step's activations: the bf16 GEMV for
bf16 activations of up to GEMV_MAX_ROWS tokens, the GGUF block kernels (one type per
matmul) for float32 or bf16 activations of any count; and where the step is decode only,
with no per-layer hook (a P/D worker's layer-by-layer KV push or load). Elsewhere the
decoder's Python forward runs.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import NamedTuple

import torch

from splitserve.model.attention import AttentionMetadata
from splitserve.model.linear import Linear
from splitserve.model.quant_linear import BEST_ISA, K_QUANT_TYPES, KERNEL_DTYPES, QuantLinear

# the op's linear kernels (csrc/decode_layers.cpp)
GEMV_KERNEL, QUANT_KERNEL, QUANT_K_KERNEL = 0, 1, 2


class LayerParts(NamedTuple):
    """What one dense layer's decode step uses, as the decoder holds it."""

    qkv_proj: torch.nn.Module
    qk_norm_weight: torch.Tensor | None  # q_norm's weight per query head, then k_norm's (Qwen3)
    o_proj: torch.nn.Module
    post_norm_weight: torch.Tensor
    gate_up_proj: torch.nn.Module
    down_proj: torch.nn.Module
    next_norm_weight: torch.Tensor | None  # the next layer's input norm (None: the last layer)


class DecodeLayersPlan(NamedTuple):
    """The op's arguments that do not change from step to step, for one activation dtype."""

    dtype: torch.dtype
    max_tokens: int  # the most decode tokens a step may have (the bf16 GEMV's row limit)
    weights: list[torch.Tensor | None]
    kinds: list[int]


class LinearCall(NamedTuple):
    weight: torch.Tensor
    bias: torch.Tensor | None
    kernel: int
    qtype: int
    max_tokens: int


def linear_call(module: torch.nn.Module, dtype: torch.dtype) -> LinearCall | None:
    """How the op multiplies by `module` for activations of `dtype`; None where the Python
    forward would run another path (oneDNN, a dequantized weight, mixed block types)."""
    if type(module) is QuantLinear and dtype in KERNEL_DTYPES:
        kernel = QUANT_K_KERNEL if module.qtype in K_QUANT_TYPES else QUANT_KERNEL
        return LinearCall(module.blocks, module.bias_for_kernel(), kernel, module.qtype.value, sys.maxsize)
    if type(module) is Linear and dtype == torch.bfloat16 and module.gemv_max_rows:
        weight = module.weight.detach()
        bias = None if module.bias is None else module.bias.detach()
        return LinearCall(weight, bias, GEMV_KERNEL, 0, module.gemv_max_rows)
    return None


def plan_decode_layers(layers: Sequence[LayerParts], dtype: torch.dtype) -> DecodeLayersPlan | None:
    """The op's fixed arguments for these layers, or None where one of their matmuls has no
    kernel the op calls for `dtype`."""
    weights: list[torch.Tensor | None] = []
    kinds: list[int] = []
    max_tokens = sys.maxsize
    for parts in layers:
        modules = (parts.qkv_proj, parts.o_proj, parts.gate_up_proj, parts.down_proj)
        calls = [linear_call(module, dtype) for module in modules]
        if any(call is None for call in calls):
            return None
        qkv, o, gate_up, down = calls
        assert qkv is not None and o is not None and gate_up is not None and down is not None
        weights += [qkv.weight, qkv.bias, parts.qk_norm_weight, o.weight, o.bias, parts.post_norm_weight]
        weights += [gate_up.weight, gate_up.bias, down.weight, down.bias, parts.next_norm_weight]
        for call in (qkv, o, gate_up, down):
            kinds += [call.kernel, call.qtype]
            max_tokens = min(max_tokens, call.max_tokens)
    return DecodeLayersPlan(dtype, max_tokens, weights, kinds)


class DecodeShape(NamedTuple):
    num_heads: int
    num_kv_heads: int
    rms_eps: float
    qk_eps: float  # the per-head q/k norms' (0 without them)
    scale: float


def run_decode_layers(
    plan: DecodeLayersPlan,
    shape: DecodeShape,
    residual: torch.Tensor,  # [T, hidden], updated in place
    normed: torch.Tensor,  # [T, hidden]: the first layer's input norm of `residual`
    kv_cache: torch.Tensor,  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    cos: torch.Tensor,
    sin: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Every layer of a decode-only step; the last layer's MLP output (not yet added)."""
    return torch.ops.splitserve_cpu.decode_layers(
        residual,
        normed,
        plan.weights,
        plan.kinds,
        kv_cache,
        cos,
        sin,
        meta.slot_mapping,
        meta.decode_block_tables,
        meta.decode_context_lens,
        shape.num_heads,
        shape.num_kv_heads,
        shape.rms_eps,
        shape.qk_eps,
        shape.scale,
        BEST_ISA,
    )
