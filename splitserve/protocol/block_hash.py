"""Chained cryptographic block hashes for the prefix cache (pure Python, no torch).

A block's hash is H(parent hash, the block's token IDs, extra keys). Extra keys are the
cache_salt (first block only) and the hashes of multimodal items overlapping the block.
H is blake2b, so hashes can cross process and tenant boundaries: the render tier and the
router compute the same values as the engine. Only full blocks are hashed. Here in
`protocol/` because the hashes travel on the wire (render results, KV events, KV
transfers) and both the render tier and the engine compute them; with them the block
arithmetic (`cdiv`) the engine's block manager and the KV connector share.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NamedTuple

BlockHash = bytes  # 16-byte blake2b digest; use .hex() on the wire

_ROOT = b"splitserve-block-hash-v1"


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the number of b-sized blocks that cover a tokens."""
    return -(-a // b)


class MultiModalSpan(NamedTuple):
    """A multimodal item occupying prompt positions [offset, offset + length)."""

    offset: int
    length: int
    item_hash: str


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    h.update(_ROOT if parent_hash is None else parent_hash)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    for key in extra_keys:
        encoded = key.encode()
        h.update(struct.pack("<I", len(encoded)))
        h.update(encoded)
    return h.digest()


def block_extra_keys(
    block_index: int, block_size: int, cache_salt: str | None, mm_spans: Sequence[MultiModalSpan] = ()
) -> tuple[str, ...]:
    start, end = block_index * block_size, (block_index + 1) * block_size
    keys: list[str] = []
    if block_index == 0 and cache_salt:
        keys.append("salt:" + cache_salt)
    for span in mm_spans:
        if span.offset < end and span.offset + span.length > start:
            keys.append("mm:" + span.item_hash)
    return tuple(keys)


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    cache_salt: str | None = None,
    mm_spans: Sequence[MultiModalSpan] = (),
    parent_hashes: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`. `parent_hashes` are hashes already
    computed for the leading blocks (extended incrementally as a sequence grows)."""
    hashes = list(parent_hashes)
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        block = token_ids[index * block_size : (index + 1) * block_size]
        extra = block_extra_keys(index, block_size, cache_salt, mm_spans)
        hashes.append(hash_block_tokens(parent, block, extra))
    return hashes


def kv_block_hashes(
    token_ids: Sequence[int],
    num_tokens: int,
    block_size: int,
    full_hashes: Sequence[BlockHash],
    *,
    cache_salt: str | None = None,
    mm_spans: Sequence[MultiModalSpan] = (),
) -> list[BlockHash]:
    """Hashes of the blocks that hold KV for positions [0, num_tokens): the chained hashes
    of the full blocks (`full_hashes`, as the prefix cache computed them), then for a
    partial last block its tokens hashed the same way. What a KV transfer is bound to:
    both ends compute it from their own prompt and cache_salt, and must agree."""
    num_full = num_tokens // block_size
    if len(full_hashes) < num_full:
        raise ValueError(f"{len(full_hashes)} block hashes for {num_full} full blocks")
    hashes = list(full_hashes[:num_full])
    if num_tokens % block_size:
        tail = token_ids[num_full * block_size : num_tokens]
        extra = block_extra_keys(num_full, block_size, cache_salt, mm_spans)
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tail, extra))
    return hashes
