"""The engine's seam to the KV store tier (`splitserve kvstore`, kv_store/): it offloads the
blocks the prefix cache evicts and loads a prompt's missing leading blocks back into the
prefix cache before the prompt is admitted (engine/scheduler.py's store stage).

Offload: the block manager tells this client (its BlockObserver) when a block enters the
prefix cache (its parent hash and tokens are kept by block ID) and when it leaves it; at
that moment, on the engine thread, the block's KV is copied out of the pool (one block, a
memory copy; the pool block is overwritten after the call returns) onto a bounded queue,
and a background thread puts batches of them to the store. A full queue, or a store known
to be down, drops the block and counts it: a step never waits for the store.

Load: before a waiting request is admitted, `lookup` asks the store how many of the
prompt's full blocks after the local prefix hit it holds (HAS, one round trip with a short
timeout); those load asynchronously (GET on a loader thread) into blocks the scheduler
allocated, checked twice: the store matches hash, parent hash and tokens, and this side
checks that what came back names the same hash, parent and tokens, and has the pool's
block layout. Loaded blocks enter the prefix cache and the request is admitted again: they
are then local hits for whatever KV connector the engine runs (a P/D prefill pushes them
to decode like any hit; a decode lends them). A failed or short load leaves the prefix
cache as it was (the prompt computes them: slower, never wrong). A store that does not
answer is left alone for a cool-down (doubling up to a cap), so a dead store costs one
timeout per cool-down, then nothing but the hits.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from splitserve.kv.connector.base import ConnectorRequest
from splitserve.kv_store.wire import BlockKey, StoreClient, StoreError
from splitserve.protocol.block_hash import BlockHash

logger = logging.getLogger(__name__)

COOL_DOWN_S = 2.0
MAX_COOL_DOWN_S = 60.0
POLL_S = 0.1


class LoadJob(NamedTuple):
    request_id: str
    keys: list[BlockKey]
    block_ids: list[int]
    queued_at: float


@dataclass
class KVStoreClientStats:
    """The engine side's counters (engine/api: `splitserve_kv_store_client_*` on /metrics)."""

    lookups: int = 0
    lookup_errors: int = 0
    hit_blocks: int = 0  # blocks HAS found (and that were then loaded or failed)
    loads: int = 0  # requests whose blocks loaded
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    failed_loads: int = 0
    load_seconds: float = 0.0  # from the load's admission to its blocks in the pool
    offered_blocks: int = 0  # blocks the prefix cache evicted
    offloaded_blocks: int = 0
    offloaded_bytes: int = 0
    dropped_full: int = 0  # the offload queue was full
    dropped_down: int = 0  # the store was in its cool-down
    offload_failed: int = 0  # a PUT the store did not take
    tiers: dict[str, int] = field(default_factory=dict)  # loaded blocks by the store tier that held them


class StoreHealth:
    """Whether to call the store now: after a failure, not until its cool-down is over."""

    def __init__(self, cool_down_s: float = COOL_DOWN_S) -> None:
        self.base_s = cool_down_s
        self.cool_down_s = cool_down_s
        self.until = 0.0
        self.lock = threading.Lock()

    def up(self) -> bool:
        with self.lock:
            return time.monotonic() >= self.until

    def failed(self) -> None:
        with self.lock:
            self.until = time.monotonic() + self.cool_down_s
            self.cool_down_s = min(self.cool_down_s * 2, MAX_COOL_DOWN_S)

    def answered(self) -> None:
        with self.lock:
            self.cool_down_s = self.base_s

    def reset(self) -> None:
        """Call the store now (another store: the old one's failures say nothing of it)."""
        with self.lock:
            self.cool_down_s, self.until = self.base_s, 0.0


class KVStoreClient:
    def __init__(
        self,
        host: str,
        port: int,
        token: str | None,
        *,
        timeout_s: float = 0.5,
        load_timeout_s: float = 5.0,
        queue_blocks: int = 1024,
        batch_blocks: int = 32,
        cool_down_s: float = COOL_DOWN_S,
    ) -> None:
        if queue_blocks < 1 or batch_blocks < 1:
            raise ValueError("the KV store's offload queue and batch need at least one block")
        self.address = f"{host}:{port}"
        # one socket per thread that talks to the store: a load never waits behind a PUT
        self.lookup_client = StoreClient(host, port, token, timeout_s)
        self.load_client = StoreClient(host, port, token, load_timeout_s)
        self.offload_client = StoreClient(host, port, token, load_timeout_s)
        self.health = StoreHealth(cool_down_s)
        self.batch_blocks = batch_blocks
        self.stats = KVStoreClientStats()
        self.kv_cache: torch.Tensor | None = None
        self.block_size = 0
        self.meta: dict = {}
        self.block_info: list[tuple[BlockHash | None, tuple[int, ...]] | None] = []
        self.offload_queue: queue.Queue[tuple[BlockKey, torch.Tensor]] = queue.Queue(queue_blocks)
        self.load_queue: queue.Queue[LoadJob] = queue.Queue()
        self.lock = threading.Lock()
        self.loading: set[str] = set()
        self.orphaned: set[str] = set()  # finished (aborted) while loading: blocks held
        self.finished_loading: set[str] = set()
        self.failed_loading: set[str] = set()
        self.released: set[str] = set()
        self.wakeup: Callable[[], None] = lambda: None
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self.offload_loop, name="splitserve-kv-store-offload", daemon=True),
            threading.Thread(target=self.load_loop, name="splitserve-kv-store-load", daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    # ---- set-up -------------------------------------------------------------------
    def register_kv_cache(self, kv_cache: torch.Tensor, block_size: int) -> None:
        self.kv_cache, self.block_size = kv_cache, block_size
        layers, two, num_blocks, _, heads, head_dim = kv_cache.shape
        # what a stored block must be to load here: another model or layout is refused
        self.meta = {
            "layout": "splitserve-block-v1",
            "dtype": str(kv_cache.dtype).removeprefix("torch."),
            "shape": [layers, two, block_size, heads, head_dim],
        }
        self.block_info = [None] * num_blocks

    def retarget(self, host: str, port: int) -> None:
        """Use the store at host:port from now on (the deployment's store was replaced: on
        Ray it comes back elsewhere). What the old one held is lost to this engine; a
        request or load in flight finishes against the old one or fails (a miss)."""
        for client in (self.lookup_client, self.load_client, self.offload_client):
            client.retarget(host, port)
        self.address = f"{host}:{port}"
        self.health.reset()

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        self.wakeup = wakeup

    # ---- offload (BlockObserver, on the engine thread) ----------------------------------
    def block_cached(
        self, block_id: int, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: Sequence[int]
    ) -> None:
        self.block_info[block_id] = (parent_hash, tuple(token_ids))

    def block_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        info, self.block_info[block_id] = self.block_info[block_id], None
        if info is None or self.kv_cache is None:
            return
        self.stats.offered_blocks += 1
        if self.offload_queue.full():
            self.stats.dropped_full += 1
            return
        if not self.health.up():
            with self.lock:  # the offload thread counts these too
                self.stats.dropped_down += 1
            return
        kv = self.kv_cache[:, :, block_id].clone(memory_format=torch.contiguous_format)
        self.offload_queue.put_nowait((BlockKey(block_hash, *info), kv))

    def offload_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                batch = [self.offload_queue.get(timeout=POLL_S)]
            except queue.Empty:
                continue
            while len(batch) < self.batch_blocks:
                try:
                    batch.append(self.offload_queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self.offload(batch)
            finally:
                for _ in batch:
                    self.offload_queue.task_done()

    def offload(self, batch: list[tuple[BlockKey, torch.Tensor]]) -> None:
        if not self.health.up():
            with self.lock:
                self.stats.dropped_down += len(batch)
            return
        blocks = [(key, self.meta, block_bytes(kv)) for key, kv in batch]
        try:
            stored = self.offload_client.put(blocks)
        except StoreError as exc:
            logger.warning("KV store %s: offloading %d blocks failed: %s", self.address, len(batch), exc)
            self.health.failed()
            self.stats.offload_failed += len(batch)
            return
        self.health.answered()
        self.stats.offloaded_blocks += stored
        self.stats.offloaded_bytes += sum(len(data) for _, _, data in blocks)
        self.stats.offload_failed += len(batch) - stored

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued offload has been sent (or dropped); False on timeout."""
        done = self.offload_queue.all_tasks_done
        with done:
            return done.wait_for(lambda: self.offload_queue.unfinished_tasks == 0, timeout_s)

    @property
    def offload_queue_depth(self) -> int:
        return self.offload_queue.qsize()

    # ---- the scheduler's store stage (engine thread) ---------------------------------
    def keys(self, request: ConnectorRequest, first: int, end: int) -> list[BlockKey]:
        """The store keys of the request's prompt blocks [first, end)."""
        size, tokens, hashes = self.block_size, request.prompt_token_ids, request.block_hashes
        return [
            BlockKey(hashes[i], hashes[i - 1] if i else None, tuple(tokens[i * size : (i + 1) * size]))
            for i in range(first, end)
        ]

    def lookup(self, request: ConnectorRequest, first_block: int) -> int:
        """How many of the prompt's full blocks from `first_block` on (the local hit's end)
        the store holds, never the block holding the last prompt token (its logits must
        be computed); 0 while the store is in its cool-down."""
        if self.kv_cache is None or not self.health.up():
            return 0
        end = min((request.num_prompt_tokens - 1) // self.block_size, len(request.block_hashes))
        if end <= first_block:
            return 0
        try:
            found = self.lookup_client.has(self.keys(request, first_block, end))
        except StoreError as exc:
            logger.warning(
                "KV store %s: lookup failed (%s); not asked for %.1f s",
                self.address,
                exc,
                self.health.cool_down_s,
            )
            self.health.failed()
            self.stats.lookup_errors += 1
            return 0
        self.health.answered()
        self.stats.lookups += 1
        return found

    def start_load(self, request: ConnectorRequest, first_block: int, block_ids: list[int]) -> None:
        """Load the prompt's blocks [first_block, first_block + len(block_ids)) into
        `block_ids`, on the loader thread; `take_loaded` or `take_failed` names the
        request when it is done."""
        self.stats.hit_blocks += len(block_ids)
        with self.lock:
            self.loading.add(request.request_id)
        keys = self.keys(request, first_block, first_block + len(block_ids))
        self.load_queue.put(LoadJob(request.request_id, keys, list(block_ids), time.monotonic()))

    def request_finished(self, request_id: str) -> bool:
        """The request ended: True when a load may still write into its blocks (keep them
        until `take_released` names it)."""
        with self.lock:
            if request_id in self.loading:
                self.orphaned.add(request_id)
                return True
        return False

    def take_loaded(self) -> set[str]:
        with self.lock:
            done, self.finished_loading = self.finished_loading, set()
        return done

    def take_failed(self) -> set[str]:
        with self.lock:
            failed, self.failed_loading = self.failed_loading, set()
        return failed

    def take_released(self) -> set[str]:
        """Ended requests whose load can no longer write into their blocks."""
        with self.lock:
            done, self.released = self.released, set()
        return done

    # ---- load (the loader thread) -----------------------------------------------------
    def load_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                job = self.load_queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            loaded = self.load(job)
            with self.lock:
                self.loading.discard(job.request_id)
                if job.request_id in self.orphaned:
                    self.orphaned.discard(job.request_id)
                    self.released.add(job.request_id)
                elif loaded:
                    self.finished_loading.add(job.request_id)
                else:
                    self.failed_loading.add(job.request_id)
            self.wakeup()

    def load(self, job: LoadJob) -> bool:
        """Copy the job's blocks from the store into the pool; False (nothing trusted)
        when any is missing, names another prefix, or has another layout."""
        assert self.kv_cache is not None
        try:
            found = self.load_client.get(job.keys)
        except StoreError as exc:
            logger.warning("KV store %s: load failed: %s", self.address, exc)
            self.health.failed()
            self.stats.failed_loads += 1
            return False
        problem = self.check(job, found)
        if problem is not None:
            logger.warning("KV store %s: load for %s refused: %s", self.address, job.request_id, problem)
            self.stats.failed_loads += 1
            return False
        shape = self.meta["shape"]
        blocks = [
            torch.frombuffer(bytearray(block.payload), dtype=torch.uint8)
            .view(self.kv_cache.dtype)
            .view(shape)
            for block in found
        ]
        stacked = torch.stack(blocks, dim=2)  # [layers, 2, n, block_size, heads, head_dim]
        self.kv_cache[:, :, job.block_ids] = stacked.to(self.kv_cache.device)
        self.stats.loads += 1
        self.stats.loaded_blocks += len(found)
        self.stats.loaded_bytes += sum(len(block.payload) for block in found)
        self.stats.load_seconds += time.monotonic() - job.queued_at
        for block in found:
            self.stats.tiers[block.tier] = self.stats.tiers.get(block.tier, 0) + 1
        return True

    def check(self, job: LoadJob, found: list) -> str | None:
        if len(found) != len(job.keys):
            return f"the store holds {len(found)} of {len(job.keys)} blocks now"
        expected_bytes = (
            self.kv_cache[:, :, 0].numel() * self.kv_cache.element_size() if self.kv_cache is not None else 0
        )
        for key, block in zip(job.keys, found, strict=True):
            if block.key != key:
                return f"block {key.block_hash.hex()} came back for another prefix"
            if block.meta != self.meta or len(block.payload) != expected_bytes:
                return f"block {key.block_hash.hex()} has another layout ({block.meta})"
        return None

    def shutdown(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=5)
        for client in (self.lookup_client, self.load_client, self.offload_client):
            client.close()


def block_bytes(kv: torch.Tensor) -> bytes:
    """One block's KV as bytes (from the device, if it is on one)."""
    return kv.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
