"""A store entry: a block's KV (opaque bytes and the engine's description of them,
`meta`) keyed by its chained block hash, with the parent hash and the block's token IDs
beside it; and its form on disk.

A disk entry is one file: magic, header length, JSON header, payload, then a blake2b
digest of everything before it. A file that is truncated, altered or names another hash
fails the check (decode_entry: None), never yields wrong KV.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

MAGIC = b"SSKVBLK1"
DIGEST_BYTES = 32
HEADER_LEN_BYTES = 4
# What an entry costs beyond its payload in the RAM budget: its token IDs and bookkeeping.
ENTRY_OVERHEAD_BYTES = 256


def prefix_digest(parent_hash: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """What a lookup must match besides the hash: the parent hash and the block's tokens."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"\0" if parent_hash is None else b"\1" + parent_hash)
    h.update(json.dumps(list(token_ids)).encode())
    return h.digest()


@dataclass(frozen=True)
class StoreEntry:
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    meta: dict  # the engine's description of the payload (dtype, shape); opaque here
    payload: bytes

    @property
    def check(self) -> bytes:
        return prefix_digest(self.parent_hash, self.token_ids)

    @property
    def cost(self) -> int:
        """Bytes it takes of a tier's budget."""
        return len(self.payload) + 8 * len(self.token_ids) + ENTRY_OVERHEAD_BYTES


def encode_entry(entry: StoreEntry) -> bytes:
    header = json.dumps(
        {
            "hash": entry.block_hash.hex(),
            "parent": entry.parent_hash.hex() if entry.parent_hash is not None else None,
            "tokens": list(entry.token_ids),
            "meta": entry.meta,
            "payload_bytes": len(entry.payload),
        }
    ).encode()
    body = MAGIC + len(header).to_bytes(HEADER_LEN_BYTES, "big") + header + entry.payload
    return body + hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest()


def decode_entry(data: bytes, block_hash: bytes) -> StoreEntry | None:
    """The entry a disk file holds, or None when it is truncated, corrupt or of another hash."""
    start = len(MAGIC) + HEADER_LEN_BYTES
    if len(data) < start + DIGEST_BYTES or not data.startswith(MAGIC):
        return None
    body, digest = data[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
    if hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest() != digest:
        return None
    header_len = int.from_bytes(body[len(MAGIC) : start], "big")
    try:
        header = json.loads(body[start : start + header_len])
        parent = header["parent"]
        entry = StoreEntry(
            block_hash=bytes.fromhex(header["hash"]),
            parent_hash=bytes.fromhex(parent) if parent is not None else None,
            token_ids=tuple(int(t) for t in header["tokens"]),
            meta=dict(header["meta"]),
            payload=body[start + header_len :],
        )
    except (ValueError, KeyError, TypeError):
        return None
    if entry.block_hash != block_hash or len(entry.payload) != header["payload_bytes"]:
        return None
    return entry
