"""Paged KV block accounting with reference counts and a prefix cache.

Free blocks sit in one LRU (an OrderedDict, head evicted first). A free block may still
hold a cached prefix (its hash stays in `cached` until the block is reused), so a later
request can revive it. Freed blocks without a hash go to the head: they are worth nothing.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from splitserve.engine.request import Request
from splitserve.protocol.block_hash import BlockHash, cdiv
from splitserve.protocol.kv_events import BlockRemoved, BlockStored, KVCacheEvent


class BlockObserver(Protocol):
    """Told when a block enters the prefix cache and when it leaves it (the KV store's
    offloader, engine/kv_store_client.py: an evicted block's KV is still in the pool when
    `block_evicted` is called, and is overwritten after it returns)."""

    def block_cached(
        self, block_id: int, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: Sequence[int]
    ) -> None: ...

    def block_evicted(self, block_id: int, block_hash: BlockHash) -> None: ...


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
        medium: str | None = None,
        retention_ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        # per request: how many of its leading blocks were already offered to the cache
        self.num_hashed_blocks: dict[str, int] = {}
        # cache insertions and evictions since the last take_events(), for KV event publishing
        self.events: list[KVCacheEvent] | None = [] if record_events else None
        self.medium = medium
        # Retention: a freed cached block is a prefix hit for retention_ttl_s at most (None:
        # until reused). Free cached blocks by expiry time, oldest first (the TTL is fixed,
        # so freeing order is expiry order).
        self.retention_ttl_s = retention_ttl_s
        self.clock = clock
        self.retained: OrderedDict[int, float] = OrderedDict()
        # Which cached blocks the events announce (None: every one). A hybrid model's block
        # is a hit only with a Mamba state snapshot at its end (engine/state_pool.py): only
        # those are announced, and withdrawn when either goes.
        self.announce: Callable[[BlockHash, int], bool] | None = None  # (hash, block index)
        self.announced: set[BlockHash] = set()
        self.observer: BlockObserver | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached leading blocks of the request, never covering its
        last token (whose logits must be computed)."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        now = self.clock()
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.cached.get(block_hash)
            if block_id is None or self.retained.get(block_id, now + 1) <= now:
                break  # not cached, or retained past its TTL: never handed out
            hits.append(block_id)
        return hits

    def evict_expired(self) -> int:
        """Drop the cache entries of free blocks retained past their TTL (their blocks go to
        the head of the free list, reused first); how many."""
        now, count = self.clock(), 0
        while self.retained:
            block_id, expires_at = next(iter(self.retained.items()))
            if expires_at > now:
                break
            del self.retained[block_id]
            self._evict(block_id)
            self.free.move_to_end(block_id, last=False)
            count += 1
        return count

    def can_allocate(
        self, request: Request, num_tokens: int, new_computed_blocks: Iterable[int] = ()
    ) -> bool:
        computed = list(new_computed_blocks)
        num_needed = cdiv(num_tokens, self.block_size) - len(request.block_ids) - len(computed)
        reviving = sum(1 for b in computed if self.ref_counts[b] == 0)
        return num_needed + reviving <= len(self.free)

    def allocate_slots(
        self, request: Request, num_tokens: int, new_computed_blocks: Iterable[int] = ()
    ) -> bool:
        """Make `request.block_ids` cover `num_tokens` positions, first taking the prefix
        hits `new_computed_blocks`. False (and nothing changed) when blocks run out."""
        computed = list(new_computed_blocks)
        if not self.can_allocate(request, num_tokens, computed):
            return False
        for block_id in computed:
            if self.ref_counts[block_id] == 0:
                del self.free[block_id]
                self.retained.pop(block_id, None)
            self.ref_counts[block_id] += 1
            request.block_ids.append(block_id)
        if computed:
            self.num_hashed_blocks[request.request_id] = len(request.block_ids)
        for _ in range(cdiv(num_tokens, self.block_size) - len(request.block_ids)):
            block_id, _ = self.free.popitem(last=False)
            self.retained.pop(block_id, None)  # memory pressure releases retained blocks early
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            request.block_ids.append(block_id)
        return True

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            if self.cached.get(block_hash) == block_id:
                del self.cached[block_hash]
                if self.observer is not None:
                    self.observer.block_evicted(block_id, block_hash)
                if self.announce is not None:
                    self.withdraw(block_hash)
                elif self.events is not None:
                    self.events.append(BlockRemoved([block_hash], self.medium))
            self.block_hashes[block_id] = None

    def withdraw(self, block_hash: BlockHash) -> None:
        """The block is no longer announced as a hit (its KV, or for a hybrid model the
        state snapshot at its end, is gone): a BlockRemoved event, if it was announced."""
        if block_hash in self.announced:
            self.announced.discard(block_hash)
            if self.events is not None:
                self.events.append(BlockRemoved([block_hash], self.medium))

    def cache_full_blocks(self, request: Request) -> None:
        """Offer the request's newly full, computed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        start = self.num_hashed_blocks.get(request.request_id, 0)
        end = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        stored: list[int] = []  # indexes of the blocks this call enters into the cache
        for index in range(start, end):
            block_id, block_hash = request.block_ids[index], request.block_hashes[index]
            if self.block_hashes[block_id] is None and block_hash not in self.cached:
                self.block_hashes[block_id] = block_hash
                self.cached[block_hash] = block_id
                stored.append(index)
                if self.observer is not None:
                    parent = request.block_hashes[index - 1] if index > 0 else None
                    tokens = request.all_token_ids[index * self.block_size : (index + 1) * self.block_size]
                    self.observer.block_cached(block_id, block_hash, parent, tokens)
        if end > start:
            self.num_hashed_blocks[request.request_id] = end
        if self.events is not None and self.announce is not None:
            stored = [i for i in stored if self.announce(request.block_hashes[i], i)]
            self.announced.update(request.block_hashes[i] for i in stored)
        if self.events is not None and stored:
            self._record_stored(request, stored)

    def _record_stored(self, request: Request, indexes: list[int]) -> None:
        """One BlockStored per run of consecutive block indexes (vLLM's shape: a chain of
        hashes, its parent's hash, and the tokens of all its blocks)."""
        runs: list[list[int]] = []
        for index in indexes:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        assert self.events is not None
        for run in runs:
            first, last = run[0], run[-1]
            self.events.append(
                BlockStored(
                    block_hashes=[request.block_hashes[i] for i in run],
                    parent_block_hash=request.block_hashes[first - 1] if first > 0 else None,
                    token_ids=request.all_token_ids[first * self.block_size : (last + 1) * self.block_size],
                    block_size=self.block_size,
                    medium=self.medium,
                )
            )

    def take_events(self) -> list[KVCacheEvent]:
        """The cache events recorded since the last call (empty when not recording)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def free_blocks(self, request: Request) -> None:
        """Release the request's blocks, last block first (evicted before its prefix)."""
        for block_id in reversed(request.block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free[block_id] = None
                if self.block_hashes[block_id] is None:
                    self.free.move_to_end(block_id, last=False)
                elif self.retention_ttl_s is not None:
                    self.retained[block_id] = self.clock() + self.retention_ttl_s
        request.block_ids = []
        self.num_hashed_blocks.pop(request.request_id, None)

    def check_integrity(self, holders: Iterable[Request]) -> None:
        """Raise AssertionError if the accounting is inconsistent with `holders`, the
        requests that currently own blocks."""
        counts = [0] * self.num_blocks
        for request in holders:
            assert len(set(request.block_ids)) == len(request.block_ids), f"{request} holds a block twice"
            for block_id in request.block_ids:
                counts[block_id] += 1
        assert counts == self.ref_counts, "reference counts differ from the holders' blocks"
        free_ids = {b for b in range(self.num_blocks) if self.ref_counts[b] == 0}
        assert set(self.free) == free_ids, "free list differs from the unreferenced blocks"
        for block_hash, block_id in self.cached.items():
            assert self.block_hashes[block_id] == block_hash, f"cache entry of block {block_id} is stale"
        for block_id in self.retained:
            assert self.ref_counts[block_id] == 0 and self.block_hashes[block_id] is not None, (
                f"retained block {block_id} is in use or uncached"
            )
        for block_id, block_hash in enumerate(self.block_hashes):
            if block_hash is not None:
                assert self.cached.get(block_hash) == block_id, f"block {block_id} hashed but not cached"
        assert self.announced <= self.cached.keys(), "an announced block is not cached"
