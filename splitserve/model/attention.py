"""Paged attention in plain PyTorch (runs on CPU and CUDA).

A step's tokens are flattened; decode-like requests (one new token each) come first and
are attended in one batched call over their gathered blocks; prefill chunks follow, one
scaled_dot_product_attention call each (they are compute bound, the loop costs nothing).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class PrefillChunk(NamedTuple):
    token_start: int  # offset in the flattened step
    num_tokens: int
    position_start: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # int64 [num_blocks_needed]


class DecodeGroup(NamedTuple):
    """Decode rows of similar context length, padded to the group's longest context."""

    row_start: int
    num_rows: int
    slots: torch.Tensor  # int64 [num_rows * max_context]: cache slot of each key (padding: 0)
    bias: torch.Tensor  # float [1, num_rows, 1, max_context]: 0 for real keys, -inf for padding


class AttentionMetadata(NamedTuple):
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset
    num_decode_tokens: int  # the first num_decode_tokens tokens are one per request
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_layer: [2, num_blocks, block_size, kv_heads, head_dim]; k, v: [T, kv_heads, head_dim]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_layer[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_layer[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim] (this step's, already written to the cache)
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    out = torch.empty_like(q)
    for group in meta.decode_groups:
        rows = slice(group.row_start, group.row_start + group.num_rows)
        out[rows] = _decode_attention(q[rows], kv_layer, group, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        if chunk.position_start == 0:
            keys, values, mask, causal = k[rows], v[rows], None, True
        else:
            context = chunk.position_start + chunk.num_tokens
            keys = kv_layer[0, chunk.block_table].reshape(-1, num_kv_heads, head_dim)[:context]
            values = kv_layer[1, chunk.block_table].reshape(-1, num_kv_heads, head_dim)[:context]
            query_pos = torch.arange(chunk.position_start, context, device=q.device)
            mask = torch.arange(context, device=q.device)[None, :] <= query_pos[:, None]
            causal = False
        # 4-D inputs reach the fused CPU kernel (3-D GQA falls back to the math path)
        attn = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[rows] = attn[0].transpose(0, 1)
    return out


def _decode_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, group: DecodeGroup, scale: float
) -> torch.Tensor:
    """One query per request against its whole context. Keys are gathered straight into
    [kv_heads, rows, context, head_dim] so that the query heads sharing a KV head form
    one batched matmul, with no transpose copy of the keys."""
    rows, num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.shape[3]
    group_size = num_heads // num_kv_heads
    context = group.slots.shape[0] // rows
    flat_k = kv_layer[0].view(-1, num_kv_heads, head_dim).transpose(0, 1)  # [kvh, slots, D] view
    flat_v = kv_layer[1].view(-1, num_kv_heads, head_dim).transpose(0, 1)
    keys = flat_k.index_select(1, group.slots).view(num_kv_heads, rows, context, head_dim)
    values = flat_v.index_select(1, group.slots).view(num_kv_heads, rows, context, head_dim)
    queries = (q * scale).view(rows, num_kv_heads, group_size, head_dim).transpose(0, 1)  # [kvh, B, G, D]
    scores = torch.matmul(queries, keys.transpose(-1, -2)).float()  # [kvh, B, G, L]
    scores += group.bias
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, values)  # [kvh, B, G, D]
    return out.transpose(0, 1).reshape(rows, num_heads, head_dim)
