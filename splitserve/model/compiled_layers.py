"""A step of a dense decoder's layers in one compiled call (csrc/compiled_layers.cpp).

At batch 1 a layer's math is a few hundred microseconds of weight reads, and each of its
nine kernel calls costs ~10 us of Python (module calls, wrappers, checks, allocations):
a quarter of a SmolLM2-135M decode step, and of a short prompt's prefill. The op runs the
same kernels in the same order on buffers of the same shapes, so a step's outputs equal
the module-by-module path's bit for bit (tests/model/test_compiled_layers.py).

It applies where every layer is plain attention + MLP whose matmuls run a kernel the op
calls for the step: the bf16 GEMV (bf16 activations, at most GEMV_MAX_ROWS tokens),
oneDNN's packed bf16 matmul (more tokens), or the GGUF block kernels (one type per
matmul, float32 or bf16 activations, any count); where each prefill chunk's attention is
the compiled bf16 kernel (float32 prefills run PyTorch's reference attention); and where
no per-layer hook runs (a P/D worker's layer-by-layer KV push or load). Elsewhere the
decoder's module-by-module forward runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from splitserve.model.attention import AttentionMetadata
from splitserve.model.linear import Linear
from splitserve.model.quant_linear import BEST_ISA, K_QUANT_TYPES, KERNEL_DTYPES, QuantLinear

# the op's linear kernels (csrc/compiled_layers.cpp)
GEMV_KERNEL, QUANT_KERNEL, QUANT_K_KERNEL, PACKED_KERNEL = 0, 1, 2, 3


class LayerParts(NamedTuple):
    """What one dense layer's step uses, as the decoder holds it."""

    qkv_proj: torch.nn.Module
    qk_norm_weight: torch.Tensor | None  # q_norm's weight per query head, then k_norm's (Qwen3)
    o_proj: torch.nn.Module
    post_norm_weight: torch.Tensor
    gate_up_proj: torch.nn.Module
    down_proj: torch.nn.Module
    next_norm_weight: torch.Tensor | None  # the next layer's input norm (None: the last layer)


class LayersPlan(NamedTuple):
    """The op's arguments that do not change from step to step, for one activation dtype
    and one side of the GEMV's row limit."""

    weights: list[torch.Tensor | None]
    kinds: list[int]


class LinearCall(NamedTuple):
    weight: torch.Tensor
    bias: torch.Tensor | None
    kernel: int
    qtype: int


def linear_call(module: torch.nn.Module, dtype: torch.dtype, few_rows: bool) -> LinearCall | None:
    """How the op multiplies by `module` as its forward would for activations of `dtype`
    (`few_rows`: at most the GEMV's row limit); None where that forward runs another path
    (F.linear, a dequantized weight, mixed block types)."""
    if type(module) is QuantLinear and dtype in KERNEL_DTYPES:
        kernel = QUANT_K_KERNEL if module.qtype in K_QUANT_TYPES else QUANT_KERNEL
        return LinearCall(module.blocks, module.bias_for_kernel(), kernel, module.qtype.value)
    if type(module) is not Linear:
        return None
    bias = None if module.bias is None else module.bias.detach()
    if few_rows and module.gemv_max_rows and dtype == torch.bfloat16:
        return LinearCall(module.weight.detach(), bias, GEMV_KERNEL, 0)
    if module.packed_weight is not None and dtype == module.packed_weight.dtype:
        return LinearCall(module.packed_weight, bias, PACKED_KERNEL, 0)
    return None


def plan_layers(layers: Sequence[LayerParts], dtype: torch.dtype, few_rows: bool) -> LayersPlan | None:
    """The op's fixed arguments for these layers, or None where one of their matmuls has no
    kernel the op calls."""
    weights: list[torch.Tensor | None] = []
    kinds: list[int] = []
    for parts in layers:
        modules = (parts.qkv_proj, parts.o_proj, parts.gate_up_proj, parts.down_proj)
        calls = [linear_call(module, dtype, few_rows) for module in modules]
        if any(call is None for call in calls):
            return None
        qkv, o, gate_up, down = calls
        assert qkv is not None and o is not None and gate_up is not None and down is not None
        weights += [qkv.weight, qkv.bias, parts.qk_norm_weight, o.weight, o.bias, parts.post_norm_weight]
        weights += [gate_up.weight, gate_up.bias, down.weight, down.bias, parts.next_norm_weight]
        for call in (qkv, o, gate_up, down):
            kinds += [call.kernel, call.qtype]
    return LayersPlan(weights, kinds)


class LayersShape(NamedTuple):
    num_heads: int
    num_kv_heads: int
    rms_eps: float
    qk_eps: float  # the per-head q/k norms' (0 without them)
    scale: float


def run_compiled_layers(
    plan: LayersPlan,
    shape: LayersShape,
    residual: torch.Tensor,  # [T, hidden], updated in place
    normed: torch.Tensor,  # [T, hidden]: the first layer's input norm of `residual`
    kv_cache: torch.Tensor,  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    cos: torch.Tensor,
    sin: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Every layer of the step; the last layer's MLP output (not yet added)."""
    chunk_rows = [n for c in meta.prefills for n in (c.token_start, c.num_tokens, c.position_start)]
    return torch.ops.splitserve_cpu.compiled_layers(
        residual,
        normed,
        plan.weights,
        plan.kinds,
        kv_cache,
        cos,
        sin,
        meta.slot_mapping,
        meta.num_decode_tokens,
        meta.decode_block_tables,
        meta.decode_context_lens,
        chunk_rows,
        [c.block_table for c in meta.prefills],
        shape.num_heads,
        shape.num_kv_heads,
        shape.rms_eps,
        shape.qk_eps,
        shape.scale,
        BEST_ISA,
    )
