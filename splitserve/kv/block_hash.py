"""Block arithmetic of the KV cache (the block hashes themselves are
`protocol/block_hash.py`: the render tier computes them too)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the number of b-sized blocks that cover a tokens."""
    return -(-a // b)
