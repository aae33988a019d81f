"""Paged attention over a step's flattened tokens (runs on CPU and CUDA).

Decode-like requests (one new token each) come first and are attended in one call that
reads their context straight from the cache blocks (ops.paged_decode_attention); prefill
chunks follow, one scaled_dot_product_attention call each (they are compute bound, the
loop costs nothing).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from splitserve.model import ops


class PrefillChunk(NamedTuple):
    token_start: int  # offset in the flattened step
    num_tokens: int
    position_start: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # int64 [num_blocks_needed]


class AttentionMetadata(NamedTuple):
    """Built once per step, read by every layer."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset
    num_decode_tokens: int  # the first num_decode_tokens tokens are one per request
    decode_block_tables: torch.Tensor  # int32 [num_decode_tokens, max_blocks], padded
    decode_context_lens: torch.Tensor  # int32 [num_decode_tokens]: this step's token included
    prefills: list[PrefillChunk]


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim] (this step's, already written to the cache)
    v: torch.Tensor,
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    decodes = meta.num_decode_tokens
    if decodes:
        ops.paged_decode_attention(
            out[:decodes], q[:decodes], kv_layer, meta.decode_block_tables, meta.decode_context_lens, scale
        )
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
