"""Bidirectional P/D: a decode worker lends the prefix it already holds to prefill, by hash.

For turn N+1 of a conversation, the decode worker that served turn N holds the earlier
turns' KV, the answer it generated included, which no prefill worker ever computed. When a
decode request reserves blocks for the KV a prefill worker will push, its leading blocks
are its own prefix-cache hit: matched by the chained block hash of this request's tokens
(cache_salt in the first block), never by position. Decode offers exactly those blocks,
with their hashes, under a lease named `<request_id>@prefix-<random>`; the prefill worker
pulls the leading run of the offer whose hashes equal its own request's, computes
everything after the first difference, and pushes the new blocks back as usual.

A lease lends only the blocks it names (the transport asks `is_held` before every read)
and ends when the reader releases it, when decode's own transfer for the request
succeeded (prefill has long finished reading), or after the reservation TTL. While it is
active a finished decode request's blocks are not freed. Blocks retained past their TTL
are never offered: the prefix match that found them already skips them.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from splitserve.kv.connector.pd_loads import Load
from splitserve.kv.connector.reservations import HoldTable
from splitserve.protocol.block_hash import BlockHash
from splitserve.protocol.kv_transfer import KVTransferParams, TransferMode

if TYPE_CHECKING:
    from splitserve.kv.connector.base import ConnectorRequest

LEND_MARK = "@prefix-"


class PrefixLends:
    """Decode side: leases on live requests' prefix blocks, one per request. A lease's name
    carries a random part: knowing a request's ID is not enough to read under its lease."""

    def __init__(self, ttl_s: float, on_ended: Callable[[str, bool], None]):
        self._on_ended = on_ended  # (request_id, expired)
        self._table = HoldTable(ttl_s, self._ended)
        self._lock = threading.Lock()
        self._lend_of: dict[str, str] = {}  # request ID -> its lease's name

    def lend(self, request_id: str, block_ids: Sequence[int], block_hashes: Sequence[str]) -> str:
        lend_id = f"{request_id}{LEND_MARK}{secrets.token_hex(8)}"
        with self._lock:
            self._lend_of[request_id] = lend_id
        self._table.hold(lend_id, list(block_ids), block_hashes)
        return lend_id

    def is_held(self, lend_id: str, block_ids: list[int], block_hashes: list[str]) -> bool:
        return LEND_MARK in lend_id and self._table.is_held(lend_id, block_ids, block_hashes)

    def release(self, lend_id: str) -> bool:
        return LEND_MARK in lend_id and self._table.release(lend_id)

    def release_for(self, request_id: str) -> bool:
        with self._lock:
            lend_id = self._lend_of.get(request_id)
        return lend_id is not None and self._table.release(lend_id)

    def active(self) -> int:
        return self._table.active()

    def clear(self) -> None:
        self._table.clear()

    def _ended(self, lend_id: str, how: str) -> None:
        request_id = lend_id.rsplit(LEND_MARK, 1)[0]
        with self._lock:
            self._lend_of.pop(request_id, None)
        self._on_ended(request_id, how == "expired")


def matched_prefix_blocks(own: Sequence[BlockHash], offered: Sequence[str], max_blocks: int) -> int:
    """Prefill side: how many leading blocks of decode's offer carry this request's own
    chained hashes (the first difference ends the run; everything after is computed)."""
    count = 0
    for own_hash, offered_hash in zip(own[:max_blocks], offered, strict=False):
        if own_hash.hex() != offered_hash:
            break
        count += 1
    return count


def pullable_prefix_tokens(
    request: ConnectorRequest,
    num_computed_tokens: int,
    params: KVTransferParams,
    block_size: int,
    mode: TransferMode,
) -> int:
    """Prefill: tokens of decode's offered prefix beyond our own hit whose chained block
    hashes equal this request's (0 without a usable offer)."""
    offer = params.prefix_offer()
    if offer is None or mode != "push" or params.invalid:
        return 0
    max_blocks = min((request.num_prompt_tokens - 1) // block_size, len(offer[1]))
    matched = matched_prefix_blocks(request.block_hashes, offer[2], max_blocks)
    return max(0, matched * block_size - num_computed_tokens)


def prefill_prompt_sources(
    request: ConnectorRequest, params: KVTransferParams, prefix: Load | None, block_size: int
) -> dict:
    """Prefill: where this prompt's KV came from, and where reuse stopped (the first block
    neither in our cache nor pulled: the first whose hash differs, or the uncached rest)."""
    pulled_ok = prefix is not None and prefix.ok
    local = int(request.metrics.get("prefix_hit_tokens") or 0)
    pulled = int(request.metrics.get("pulled_tokens") or 0) if pulled_ok else 0
    offer = params.prefix_offer()
    sources: dict = {
        "reused_tokens": local,
        "pulled_tokens": pulled,
        "recomputed_tokens": max(0, request.num_prompt_tokens - local - pulled),
        "pulled_blocks": prefix.num_blocks if prefix is not None and pulled_ok else 0,
        "offered_blocks": len(offer[1]) if offer is not None else 0,
        "reuse_stopped_block": (local + pulled) // max(block_size, 1),
    }
    if prefix is not None and not prefix.ok:
        sources["pull_error"] = prefix.error
    return sources
