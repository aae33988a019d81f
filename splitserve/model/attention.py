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


class AttentionMetadata(NamedTuple):
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset
    num_decode_tokens: int  # the first num_decode_tokens tokens are one per request
    decode_block_tables: torch.Tensor  # int64 [num_decodes, max_blocks]
    decode_mask: torch.Tensor  # bool [num_decodes, 1, 1, max_blocks * block_size], True = attend
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
    num_decodes = meta.num_decode_tokens
    if num_decodes:
        out[:num_decodes] = _decode_attention(q[:num_decodes], kv_layer, meta, scale)
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
        attn = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[rows] = attn.transpose(0, 1)
    return out


def _decode_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """One query per request against its whole context: grouped heads share each K/V
    head, so the scores are one batched matmul per step and layer."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.shape[3]
    group = num_heads // num_kv_heads
    tables = meta.decode_block_tables
    # [B, max_blocks, block_size, kv_heads, D] -> [B, kv_heads, L, D]
    keys = kv_layer[0][tables].flatten(1, 2).permute(0, 2, 1, 3)
    values = kv_layer[1][tables].flatten(1, 2).permute(0, 2, 1, 3)
    queries = q.view(batch, num_kv_heads, group, head_dim)
    scores = torch.matmul(queries, keys.transpose(-1, -2)).float() * scale  # [B, kvh, G, L]
    scores.masked_fill_(~meta.decode_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values).reshape(batch, num_heads, head_dim)
