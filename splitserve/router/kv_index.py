"""The router's prefix-cache index: block hash → the workers that hold it, from KV events.

Each worker's engine publishes what enters and leaves its prefix cache
(`protocol/kv_events.py`); `KVEventFeed` applies those batches here. A request's render
carries its chained block hashes (cache_salt included, so tenants never match each
other); the leading run a worker holds is what it would not recompute. Scoring (Dynamo's
shape, router/routing.py): cost = overlap_weight × blocks to prefill + the worker's load
(router/load.py), lowest wins.

A KV store tier (docs/kv-store.md) publishes the same events, its `medium` naming the
tier that holds each block ("CPU" for RAM, "DISK" for disk). Any engine loads the store's
blocks past its own prefix hit, so the store's leading run after a worker's local run is
credited to every worker, below a local block (a load costs more than a hit): by default
0.75 of a block held in RAM, 0.25 of one on disk (Dynamo's host and disk weights).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from splitserve.runtime.kv_events import KVEventSubscriber

logger = logging.getLogger(__name__)

RESTART_CHECK_IDLE_POLLS = 10  # idle polls (of poll_ms each) between restart checks


@dataclass(frozen=True)
class KVRoutingWeights:
    overlap_weight: float = 1.0  # per prompt block the worker would have to prefill
    # per block (block_size tokens) of prompts queued for prefill on the worker: they are
    # computed before this one, so they delay its first token like its own blocks
    prefill_load_weight: float = 1.0
    # per KV block held by the worker's decoding requests (they share every step with
    # this request's prefill)
    decode_load_weight: float = 0.1
    load_weight: float = 0.0  # per request the worker has in flight (the router's count)
    # what a block of the KV store is worth beside one in the worker's pool (1): loaded, not hit
    store_ram_credit: float = 0.75
    store_disk_credit: float = 0.25

    def __post_init__(self) -> None:
        for name in ("overlap_weight", "prefill_load_weight", "decode_load_weight", "load_weight"):
            value = getattr(self, name)
            if not value >= 0:  # also rejects NaN
                raise ValueError(f"{name} must be >= 0, not {value}")
        for name in ("store_ram_credit", "store_disk_credit"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"{name} must be in [0, 1], not {value}")

    @property
    def store_credits(self) -> dict[str, float]:
        """A store-held block's credit by the medium its events name."""
        return {"CPU": self.store_ram_credit, "DISK": self.store_disk_credit}


class KVBlockIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[bytes, set[str]] = {}
        self._held: dict[str, set[bytes]] = {}
        # per KV store (by the name its events are applied under): block → the medium holding it
        self._store_media: dict[str, dict[bytes, str]] = {}

    def add_store(self, name: str) -> None:
        """Apply `name`'s events as a KV store's (blocks every worker can load, by tier),
        not a worker's."""
        with self._lock:
            self._store_media.setdefault(name, {})

    def remove_store(self, name: str) -> None:
        """`name` is no KV store any more (it was replaced): its blocks are no one's."""
        with self._lock:
            self._store_media.pop(name, None)

    def apply(self, worker: str, batch: KVEventBatch) -> None:
        with self._lock:
            media = self._store_media.get(worker)
            if media is not None:
                apply_store_events(media, batch)
                return
            held = self._held.setdefault(worker, set())
            for event in batch.events:
                if isinstance(event, BlockStored):
                    for block_hash in event.block_hashes:
                        held.add(block_hash)
                        self._holders.setdefault(block_hash, set()).add(worker)
                elif isinstance(event, BlockRemoved):
                    for block_hash in event.block_hashes:
                        held.discard(block_hash)
                        self._drop_holder(block_hash, worker)
                elif isinstance(event, AllBlocksCleared):
                    self._clear(worker)

    def clear(self, worker: str) -> None:
        with self._lock:
            self._clear(worker)

    def _clear(self, worker: str) -> None:
        if worker in self._store_media:
            self._store_media[worker].clear()
        for block_hash in self._held.pop(worker, set()):
            self._drop_holder(block_hash, worker)

    def _drop_holder(self, block_hash: bytes, worker: str) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[block_hash]

    def matched_blocks(self, worker: str, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the chain `worker` holds."""
        with self._lock:
            count = 0
            for block_hash in block_hashes:
                if worker not in self._holders.get(block_hash, ()):
                    break
                count += 1
            return count

    def store_credit(self, block_hashes: Sequence[bytes], start: int, credits: Mapping[str, float]) -> float:
        """What the leading run of `block_hashes[start:]` a KV store holds is worth, block
        by block by the tier holding it (`credits`, by medium): a worker whose own run ends
        at `start` loads those from the store."""
        with self._lock:
            if not self._store_media:
                return 0.0
            total = 0.0
            for block_hash in block_hashes[start:]:
                medium = next((m[block_hash] for m in self._store_media.values() if block_hash in m), None)
                if medium is None:
                    break
                total += credits.get(medium, 0.0)
            return total

    def store_blocks(self) -> dict[str, int]:
        """The blocks the KV stores hold, by medium."""
        with self._lock:
            counts: dict[str, int] = {}
            for media in self._store_media.values():
                for medium in media.values():
                    counts[medium] = counts.get(medium, 0) + 1
            return counts

    def held(self, worker: str) -> set[bytes]:
        with self._lock:
            return set(self._held.get(worker, ()))

    def num_blocks(self) -> dict[str, int]:
        with self._lock:
            return {worker: len(hashes) for worker, hashes in self._held.items()}


def apply_store_events(media: dict[bytes, str], batch: KVEventBatch) -> None:
    """A KV store's batch: which medium holds each block. A demotion is a removal from
    one medium and a store into the other, in either order."""
    for event in batch.events:
        if isinstance(event, BlockStored):
            for block_hash in event.block_hashes:
                media[block_hash] = event.medium or "CPU"
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                if event.medium is None or media.get(block_hash) == event.medium:
                    media.pop(block_hash, None)
        elif isinstance(event, AllBlocksCleared):
            media.clear()


def request_block_hashes(request: GenerateRequest) -> list[bytes]:
    """The chained block hashes the render tier attached to a generate request (hex)."""
    if request.block_hashes is None:
        return []
    try:
        return [bytes.fromhex(h) for h in request.block_hashes]
    except ValueError:
        return []


class KVEventFeed:
    """One thread per watched worker: subscribe to its events, replay what it already
    published, and keep `index` current; a restarted publisher (its numbers start over)
    or a gap the replay cannot fill drops the worker's blocks first (the subscriber's reset
    batch) and follows from what the publisher still buffers. `unwatch` ends one worker's
    subscription and drops its blocks from the index (the worker left the pool)."""

    def __init__(self, index: KVBlockIndex, poll_ms: int = 100) -> None:
        self.index = index
        self.poll_ms = poll_ms
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: dict[str, tuple[threading.Thread, threading.Event]] = {}

    def watch(self, worker: str, endpoint: str, replay_endpoint: str | None) -> None:
        with self._lock:
            if worker in self._threads:
                return
            stop = threading.Event()
            thread = threading.Thread(
                target=self._follow,
                args=(worker, endpoint, replay_endpoint, stop),
                name=f"kv-events {worker}",
                daemon=True,
            )
            self._threads[worker] = (thread, stop)
        thread.start()

    def unwatch(self, worker: str) -> bool:
        """Stop following `worker` and forget every block the index holds for it (after
        its thread has stopped applying batches); whether it was watched."""
        with self._lock:
            watched = self._threads.pop(worker, None)
        if watched is not None:
            thread, stop = watched
            stop.set()
            thread.join(timeout=2)
        self.index.clear(worker)
        return watched is not None

    def watching(self) -> list[str]:
        with self._lock:
            return list(self._threads)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            threads = [thread for thread, _stop in self._threads.values()]
        for thread in threads:
            thread.join(timeout=2)

    def _stopped(self, stop: threading.Event) -> bool:
        return self._stop.is_set() or stop.is_set()

    def _follow(self, worker: str, endpoint: str, replay_endpoint: str | None, stop: threading.Event) -> None:
        subscriber = KVEventSubscriber(endpoint, replay_endpoint)
        try:
            self.index.clear(worker)
            if replay_endpoint is not None:
                for _seq, batch in subscriber.sync():
                    self.index.apply(worker, batch)
                # a new SUB socket misses what is published before its subscription settles
                # (ZMQ's slow joiner): once settled, replay whatever came in between
                for _seq, batch in subscriber.poll(self.poll_ms):
                    self.index.apply(worker, batch)
                for _seq, batch in subscriber.sync():
                    self.index.apply(worker, batch)
            idle_polls = 0
            while not self._stopped(stop):
                batches = subscriber.poll(self.poll_ms)
                for _seq, batch in batches:
                    self.index.apply(worker, batch)
                idle_polls = 0 if batches else idle_polls + 1
                if idle_polls >= RESTART_CHECK_IDLE_POLLS and replay_endpoint is not None:
                    # a restart (or a tail of batches) whose every live batch was missed
                    # shows only in the replay buffer: checked from last_seq, one batch
                    idle_polls = 0
                    for _seq, batch in subscriber.sync():
                        self.index.apply(worker, batch)
        except Exception:
            logger.exception("KV events of %s: the feed stopped", worker)
        finally:
            subscriber.close()
            with self._lock:
                left = self._threads.get(worker, (None, None))[1] is not stop
            if left:  # unwatched while a replay ran past unwatch's wait: drop what it applied
                self.index.clear(worker)
