"""Copying blocks of a paged KV layer (`[2, num_blocks, block_size, kv_heads, head_dim]`).

Block IDs handed out together are mostly consecutive, so copies go run by run as slices:
many times faster than gathering block by block with index_select/index_copy_.
"""

from __future__ import annotations

import torch


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both block lists are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_blocks(
    dst_layer: torch.Tensor, dst_ids: list[int], src_layer: torch.Tensor, src_ids: list[int]
) -> int:
    """Copy blocks of one layer; returns the bytes copied."""
    for s, d, n in block_runs(src_ids, dst_ids):
        dst_layer[:, d : d + n].copy_(src_layer[:, s : s + n])
    return 2 * len(src_ids) * src_layer[0, 0].numel() * src_layer.element_size()


def gather_blocks(layer: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """The blocks of one layer as a new contiguous [2, len(block_ids), ...] tensor."""
    out = torch.empty(
        (layer.shape[0], len(block_ids), *layer.shape[2:]), dtype=layer.dtype, device=layer.device
    )
    copy_blocks(out, list(range(len(block_ids))), layer, block_ids)
    return out
