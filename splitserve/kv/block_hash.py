"""Chained cryptographic block hashes for the prefix cache (pure Python, no torch).

A block's hash is H(parent hash, the block's token IDs, extra keys). The extra key is the
cache_salt (first block only); multimodal item hashes will join it with image support.
H is blake2b, so hashes can cross process and tenant boundaries: the render tier and the
router compute the same values as the engine. Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # 16-byte blake2b digest; use .hex() on the wire

_ROOT = b"splitserve-block-hash-v1"


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the number of b-sized blocks that cover a tokens."""
    return -(-a // b)


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


def block_extra_keys(block_index: int, cache_salt: str | None) -> tuple[str, ...]:
    return ("salt:" + cache_salt,) if block_index == 0 and cache_salt else ()


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    cache_salt: str | None = None,
    parent_hashes: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`. `parent_hashes` are hashes already
    computed for the leading blocks (extended incrementally as a sequence grows)."""
    hashes = list(parent_hashes)
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        block = token_ids[index * block_size : (index + 1) * block_size]
        extra = block_extra_keys(index, cache_salt)
        hashes.append(hash_block_tokens(parent, block, extra))
    return hashes
