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
    block_ids: torch.Tensor  # int64 [num_rows * max_blocks]: each row's blocks, padded with 0
    mask: torch.Tensor  # bool [num_rows, 1, 1, max_context]: True for real keys


class AttentionMetadata(NamedTuple):
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset
    num_decode_tokens: int  # the first num_decode_tokens tokens are one per request
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    # scratch for gathered decode keys and values, reused across layers and steps (a
    # fresh multi-megabyte tensor per layer costs page faults); at least
    # 2 * max(group.block_ids.numel()) * block_size * kv_heads * head_dim elements
    workspace: torch.Tensor


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
        out[rows] = _decode_attention(q[rows], kv_layer, group, scale, meta.workspace)
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
    q: torch.Tensor, kv_layer: torch.Tensor, group: DecodeGroup, scale: float, workspace: torch.Tensor
) -> torch.Tensor:
    """One query per request against its whole context. Whole blocks are gathered (one
    contiguous copy each) into the workspace and read by SDPA through a strided view."""
    rows, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_layer.shape
    block_numel = block_size * num_kv_heads * head_dim
    num_gathered = group.block_ids.shape[0]
    size = num_gathered * block_numel
    key_buf = workspace[:size].view(num_gathered, block_size, num_kv_heads, head_dim)
    value_buf = workspace[size : 2 * size].view(num_gathered, block_size, num_kv_heads, head_dim)
    torch.index_select(kv_layer[0], 0, group.block_ids, out=key_buf)
    torch.index_select(kv_layer[1], 0, group.block_ids, out=value_buf)
    context = num_gathered // rows * block_size
    keys = key_buf.view(rows, context, num_kv_heads, head_dim).transpose(1, 2)
    values = value_buf.view(rows, context, num_kv_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :],  # [B, heads, 1, D]
        keys,
        values,
        attn_mask=group.mask,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out.view(rows, num_heads, head_dim)
