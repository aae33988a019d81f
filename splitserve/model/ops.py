"""The decoder's fused memory-bound ops: a compiled CPU kernel where one is built
(native.py), else the PyTorch reference below (CUDA, or no compiler).

The KV cache is the activations' dtype, or 16-bit under float32 activations (a quantized
GGUF model's, engine/device.py choose_kv_cache_dtype): K and V are rounded to the cache's
dtype as they are written, and attention reads them back as float32 and computes in it.

Each reference is written the way transformers computes the same step (RMSNorm in
float32 then cast, RoPE and SiLU rounding to the model dtype after every op), so
float32 greedy outputs match transformers' `generate`; the kernels round at the same
points, and tests/model/test_ops.py checks every kernel against its reference.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from splitserve.model.native import use_cpu_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [rows, n] -> RMSNorm(x) * weight."""
    if use_cpu_ops(x):
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        torch.ops.splitserve_cpu.rms_norm(out, x, weight, eps)
        return out
    return rms_norm_reference(x, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += delta in place; returns RMSNorm(residual) * weight (the residual stream
    of a decoder layer and the next norm's output, in one pass)."""
    if use_cpu_ops(residual):
        out = torch.empty_like(residual)
        torch.ops.splitserve_cpu.add_rms_norm(out, residual, delta, weight, eps)
        return out
    residual.add_(delta)
    return rms_norm_reference(residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2n] -> silu(gate) * up [rows, n]."""
    if use_cpu_ops(gate_up):
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        torch.ops.splitserve_cpu.silu_and_mul(out, gate_up)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """transformers' `relu2` (ReLUSquaredActivation): Nemotron-H's MLP and expert activation."""
    return torch.square(F.relu(x))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, n] -> int64 [rows]: torch.argmax(x, dim=-1) (first maximum; NaN wins)."""
    if use_cpu_ops(x) and x.stride(-1) == 1 and x.shape[-1] > 0:
        out = torch.empty(x.shape[0], dtype=torch.long)
        torch.ops.splitserve_cpu.argmax_rows(out, x)
        return out
    return x.argmax(dim=-1)


def rope_and_cache(
    qkv: torch.Tensor,  # [tokens, (heads + 2 * kv_heads) * head_dim], rotated in place
    cos: torch.Tensor,  # [tokens, head_dim], model dtype
    sin: torch.Tensor,  # [tokens, head_dim], rotate_half's sign folded into the first half
    qk_norm_weight: torch.Tensor | None,  # [heads + kv_heads, head_dim] (Qwen3) or None
    eps: float,
    kv_layer: torch.Tensor,  # [2, blocks, block_size, kv_heads, head_dim], qkv's dtype or 16-bit
    slot_mapping: torch.Tensor,  # int64 [tokens]
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """Per-head q/k RMSNorm (if any), rotary embedding of q and k, then k and v into the
    cache slots."""
    if use_cpu_ops(qkv):
        torch.ops.splitserve_cpu.rope_and_cache(
            qkv, cos, sin, qk_norm_weight, eps, kv_layer, slot_mapping, num_heads, num_kv_heads
        )
        return
    rope_and_cache_reference(
        qkv, cos, sin, qk_norm_weight, eps, kv_layer, slot_mapping, num_heads, num_kv_heads
    )


def rope_and_cache_reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    qk_norm_weight: torch.Tensor | None,
    eps: float,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    tokens, head_dim = qkv.shape[0], kv_layer.shape[-1]
    rotated = (num_heads + num_kv_heads) * head_dim
    qk = qkv[:, :rotated].view(tokens, num_heads + num_kv_heads, head_dim)
    if qk_norm_weight is not None:
        qk = rms_norm_reference(qk, qk_norm_weight, eps)
    qkv[:, :rotated] = (qk * cos[:, None] + qk.roll(head_dim // 2, dims=-1) * sin[:, None]).view(tokens, -1)
    k = qkv[:, num_heads * head_dim : rotated].view(tokens, num_kv_heads, head_dim)
    v = qkv[:, rotated:].view(tokens, num_kv_heads, head_dim)
    kv_layer[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(kv_layer.dtype))
    kv_layer[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(kv_layer.dtype))


def paged_decode_attention(
    out: torch.Tensor,  # [seqs, heads, head_dim], written
    q: torch.Tensor,  # [seqs, heads, head_dim]: one query token per sequence
    kv_layer: torch.Tensor,  # [2, blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [seqs, max_blocks]: each sequence's blocks, padded
    context_lens: torch.Tensor,  # int32 [seqs]: tokens in the cache, this step's included
    scale: float,
) -> None:
    """Each sequence's query attends to its whole cached context."""
    if use_cpu_ops(q):
        torch.ops.splitserve_cpu.paged_decode_attention(out, q, kv_layer, block_tables, context_lens, scale)
        return
    paged_decode_attention_reference(out, q, kv_layer, block_tables, context_lens, scale)


def paged_decode_attention_reference(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> None:
    """Gathers every sequence's blocks, padded to the longest, under a key mask."""
    seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_layer.shape
    tables = block_tables.long()
    width = tables.shape[1] * block_size
    keys = kv_layer[0][tables].view(seqs, width, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    values = kv_layer[1][tables].view(seqs, width, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    mask = torch.arange(width, device=q.device)[None, :] < context_lens[:, None]
    attn = F.scaled_dot_product_attention(
        q[:, :, None, :],
        keys,
        values,
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    out.copy_(attn.view(seqs, num_heads, head_dim))


def prefill_attention(
    out: torch.Tensor,  # [tokens, heads, head_dim], written
    q: torch.Tensor,  # [tokens, heads, head_dim]: a prefill chunk's queries
    kv_layer: torch.Tensor,  # [2, blocks, block_size, kv_heads, head_dim], the chunk's KV written
    block_table: torch.Tensor,  # int32 [blocks covering position_start + tokens]
    position_start: int,  # tokens of the sequence before the chunk (cached)
    scale: float,
) -> None:
    """Causal attention of a chunk's queries over every key of their sequence up to their
    own position, read from the cache."""
    if (
        use_cpu_ops(q)
        and q.dtype == kv_layer.dtype == torch.bfloat16
        and bf16_prefill_kernel_supports(q.shape[-1])
    ):
        torch.ops.splitserve_cpu.prefill_attention(out, q, kv_layer, block_table, position_start, scale)
        return
    prefill_attention_reference(out, q, kv_layer, block_table, position_start, scale)


@functools.lru_cache(maxsize=8)
def bf16_prefill_kernel_supports(head_dim: int) -> bool:
    """Whether the compiled bf16 prefill kernel was built for this CPU and head size (asked
    once per head size: the answer is fixed at build time, and this runs per layer)."""
    return bool(torch.ops.splitserve_cpu.prefill_attention_supported(head_dim))


def prefill_attention_reference(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_table: torch.Tensor,
    position_start: int,
    scale: float,
) -> None:
    """The chunk's keys gathered from the cache, under a causal mask aligned to the end
    (the fused SDPA kernel needs 4-D inputs; 3-D GQA falls back to the math path)."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.shape[3]
    context = position_start + tokens
    blocks = block_table.long()
    keys = kv_layer[0, blocks].reshape(-1, num_kv_heads, head_dim)[:context].to(q.dtype)
    values = kv_layer[1, blocks].reshape(-1, num_kv_heads, head_dim)[:context].to(q.dtype)
    if position_start == 0:
        mask, causal = None, True
    else:
        query_pos = torch.arange(position_start, context, device=q.device)
        mask, causal = torch.arange(context, device=q.device)[None, :] <= query_pos[:, None], False
    attn = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    out.copy_(attn[0].transpose(0, 1))
