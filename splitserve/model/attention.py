"""Paged attention over a step's flattened tokens (runs on CPU and CUDA).

Decode-like requests (one new token each) come first and are attended in one call that
reads their context straight from the cache blocks (ops.paged_decode_attention); prefill
chunks follow, one ops.prefill_attention call each over the cache (they are compute
bound, the loop costs nothing).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from splitserve.model import ops


class PrefillChunk(NamedTuple):
    token_start: int  # offset in the flattened step
    num_tokens: int
    position_start: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # int32 [num_blocks_needed]


class AttentionMetadata(NamedTuple):
    """Built once per step, read by every layer."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset
    num_decode_tokens: int  # the first num_decode_tokens tokens are one per request
    decode_block_tables: torch.Tensor  # int32 [num_decode_tokens, max_blocks], padded
    decode_context_lens: torch.Tensor  # int32 [num_decode_tokens]: this step's token included
    prefills: list[PrefillChunk]


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim], this step's KV written
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    decodes = meta.num_decode_tokens
    if decodes:
        ops.paged_decode_attention(
            out[:decodes], q[:decodes], kv_layer, meta.decode_block_tables, meta.decode_context_lens, scale
        )
    for chunk in meta.prefills:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        ops.prefill_attention(out[rows], q[rows], kv_layer, chunk.block_table, chunk.position_start, scale)
    return out
