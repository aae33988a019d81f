"""Continuous batching with a per-step token budget.

Each step: running requests first (decodes, and prefills already in flight), then
waiting requests are admitted in arrival order, their prompts chunked to fill the rest
of the budget. When blocks run out the most recently admitted running request is
preempted: its blocks are freed and it is recomputed later (its prefix usually comes
back from the prefix cache).

After the model runs, `update_from_output` appends the sampled tokens and finishes the
requests that hit a stop token, max_tokens or the model's length; a finished request's
blocks are freed, or kept while the KV connector still sends from them.

With a KV store tier (engine/kv_store_client.py), a waiting request first goes through
the store stage: the blocks the store holds past its local prefix hit are loaded into
blocks allocated for them, entered into the prefix cache, and the request is admitted
again, finding them as local hits. So the connector (a P/D prefill's push, a decode's
reservation and lends) sees them as any hit, and a second connector is never needed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

from splitserve.config import SchedulerConfig
from splitserve.engine.block_manager import BlockManager, cdiv
from splitserve.engine.outputs import ModelRunnerOutput
from splitserve.engine.request import Request, RequestStatus, ScheduledRequest
from splitserve.engine.state_pool import MambaStatePool
from splitserve.kv.connector.base import KVConnector

if TYPE_CHECKING:
    from splitserve.engine.kv_store_client import KVStoreClient

logger = logging.getLogger(__name__)


class SchedulerOutput(NamedTuple):
    scheduled: list[ScheduledRequest]
    num_tokens: int
    preempted: list[Request]
    too_long: list[Request]  # can never fit the KV cache: finished with "length"


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        connector: KVConnector | None = None,
        state_pool: MambaStatePool | None = None,  # a hybrid model's per-request Mamba state
        kv_store: KVStoreClient | None = None,  # loads blocks into the prefix cache before admission
    ) -> None:
        self.config = config
        self.kv_store = kv_store
        self.state_pool = state_pool
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.connector = connector
        self.requests: dict[str, Request] = {}  # unfinished, by ID
        self.delayed_free: dict[str, Request] = {}  # finished, blocks kept for the connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_remote: dict[str, Request] = {}
        self.waiting_for_store: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    def add(self, request: Request) -> None:
        bm = self.block_manager
        request.num_cached_on_arrival = len(bm.get_computed_blocks(request)) * bm.block_size
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def request_id_in_use(self, request_id: str) -> bool:
        """Unfinished, or finished with blocks the connector still sends from."""
        return request_id in self.requests or request_id in self.delayed_free

    def has_runnable(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        too_long: list[Request] = []
        bm = self.block_manager
        prefill_cap = self.prefill_chunk_cap()

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, budget if remaining == 1 else min(budget, prefill_cap))
            target = request.num_computed_tokens + num_new
            if cdiv(target, bm.block_size) > bm.num_blocks:
                self.running.pop(index)
                too_long.append(request)
                continue
            while not bm.allocate_slots(request, target):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break
            scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new))
            budget -= num_new
            index += 1

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if preempted and request is preempted[-1]:
                break  # it was just pushed out for lack of blocks: not this step
            item = self._admit(request, min(budget, prefill_cap))
            if item is None:
                break
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.waiting_for_remote[request.request_id] = request
                continue
            if request.status == RequestStatus.WAITING_FOR_STORE:
                self.waiting_for_store[request.request_id] = request
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(item)
            budget -= item.num_tokens
        num_tokens = self.config.max_num_batched_tokens - budget
        for request in too_long:
            self._finish(request, "length")
        now = time.monotonic()
        for item in scheduled:
            if item.request.metrics["first_scheduled_time"] is None:
                item.request.metrics["first_scheduled_time"] = now
        return SchedulerOutput(scheduled, num_tokens, preempted, too_long)

    def prefill_chunk_cap(self) -> int:
        """The most prompt tokens one request computes this step: the long-prefill threshold
        while any running request decodes, else the whole budget."""
        threshold = self.config.long_prefill_token_threshold
        if threshold and any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running):
            return threshold
        return self.config.max_num_batched_tokens

    def _admit(self, request: Request, budget: int) -> ScheduledRequest | None:
        bm = self.block_manager
        pool = self.state_pool
        if pool is not None and not pool.has_slot(request.request_id) and pool.num_free_slots == 0:
            return None
        fresh = not request.block_ids and not request.store_consulted
        if self.kv_store is not None and fresh and self._load_from_store(request):
            return ScheduledRequest(request, 0, 0)
        computed_blocks: list[int] = []
        if not request.block_ids:  # fresh or preempted (a failed remote load keeps its blocks)
            computed_blocks = bm.get_computed_blocks(request)
            if pool is not None:  # a hybrid: only up to the latest Mamba state snapshot
                computed_blocks = pool.resumable_hit(request, computed_blocks)
        num_hit = len(computed_blocks) * bm.block_size
        num_external, load_async = 0, False
        if self.connector is not None and not request.connector_consulted:
            num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_hit)
            num_external = max(0, min(num_external, request.num_tokens - 1 - num_hit))
        num_computed = max(request.num_computed_tokens, num_hit + num_external)
        if load_async and num_external > 0:
            if not bm.allocate_slots(request, num_computed, computed_blocks):
                return None
            request.connector_consulted = True
            self._note_hit(request, num_hit, num_external)
            request.num_computed_tokens = num_hit  # external tokens count once loaded
            request.pending_external_tokens = num_external
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            assert self.connector is not None
            self.connector.update_state_after_alloc(request, list(request.block_ids), num_external)
            if pool is not None:
                pool.allocate(request.request_id)
                if computed_blocks:  # what a failed load recomputes from; a load overwrites it
                    pool.restore(request, len(computed_blocks))
            return ScheduledRequest(request, num_hit, 0)
        num_new = min(request.num_tokens - num_computed, budget)
        if cdiv(num_computed + num_new, bm.block_size) > bm.num_blocks:
            return None
        if not bm.allocate_slots(request, num_computed + num_new, computed_blocks):
            return None
        if self.connector is not None and not request.connector_consulted:
            request.connector_consulted = True
            request.num_computed_tokens = max(request.num_computed_tokens, num_hit)
            self.connector.update_state_after_alloc(request, list(request.block_ids), num_external)
        self._note_hit(request, num_hit, num_external)
        request.num_computed_tokens = num_computed
        if pool is not None:
            pool.allocate(request.request_id)
            if computed_blocks:
                pool.restore(request, len(computed_blocks))
        return ScheduledRequest(request, num_computed, num_new)

    def _load_from_store(self, request: Request) -> bool:
        """The store stage: ask the store for the prompt's blocks past the local hit (once
        per request) and, when it holds some, allocate blocks for them and start their load
        (True: the request waits in WAITING_FOR_STORE)."""
        assert self.kv_store is not None
        request.store_consulted = True
        bm = self.block_manager
        hits = bm.get_computed_blocks(request)
        found = self.kv_store.lookup(request, len(hits))
        # no room for them now: the prompt computes them (slower, never wrong)
        if found == 0 or not bm.allocate_slots(request, (len(hits) + found) * bm.block_size, hits):
            return False
        request.status = RequestStatus.WAITING_FOR_STORE
        self.kv_store.start_load(request, len(hits), request.block_ids[len(hits) :])
        return True

    def finish_store_loads(self) -> None:
        """Store loads done: loaded blocks enter the prefix cache; then the request's
        blocks are released and it goes back to the head of the queue, to be admitted at
        once with them as local hits (a failed load leaves nothing in the cache)."""
        assert self.kv_store is not None
        loaded, failed = self.kv_store.take_loaded(), self.kv_store.take_failed()
        for request_id in loaded | failed:
            request = self.waiting_for_store.pop(request_id, None)
            if request is None:
                continue
            if request_id in loaded and request_id not in failed:
                request.num_computed_tokens = len(request.block_ids) * self.block_manager.block_size
                self.block_manager.cache_full_blocks(request)
            self.block_manager.free_blocks(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
        for request_id in self.kv_store.take_released():
            request = self.delayed_free.pop(request_id, None)
            if request is not None:
                self.block_manager.free_blocks(request)

    def _note_hit(self, request: Request, num_hit: int, num_external: int) -> None:
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit + num_external
            # where the prompt's KV came from, reported per request (engine/api/generate.py)
            request.metrics["prefix_hit_tokens"] = num_hit
            request.metrics["received_tokens"] = num_external
            request.metrics["block_size"] = self.block_manager.block_size
            self.prefix_queried_tokens += request.num_tokens
            self.prefix_hit_tokens += num_hit

    def _preempt(self, request: Request) -> None:
        self.block_manager.free_blocks(request)
        if self.state_pool is not None:
            self.state_pool.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """The step ran: its tokens are computed (full blocks enter the prefix cache), each
        sampled token is appended, and a request that is done is finished."""
        for item in scheduler_output.scheduled:
            item.request.num_computed_tokens += item.num_tokens
            self.block_manager.cache_full_blocks(item.request)
        now = time.monotonic()
        for sampled in runner_output.sampled:
            request = sampled.request
            request.append_token(sampled.token_id)
            if request.metrics["first_token_time"] is None:
                request.metrics["first_token_time"] = now
            request.metrics["last_token_time"] = now
            reason = self.finish_reason(request)
            if reason is not None:
                self.finish_request(request, reason)

    def finish_reason(self, request: Request) -> str | None:
        """Why the request is done after its last appended token; None while it is not."""
        if request.all_token_ids[-1] in request.stop_token_ids:
            return "stop"
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish_request(self, request: Request, reason: str) -> None:
        """Take the request out of its queue and finish it ("stop", "length", "abort",
        "error")."""
        self.remove(request)
        self._finish(request, reason)

    def _finish(self, request: Request, reason: str) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.metrics["finished_time"] = time.monotonic()
        self.requests.pop(request.request_id, None)
        if self.state_pool is not None:
            self.state_pool.free(request.request_id)
        delay = False
        if self.connector is not None:
            try:
                delay, params = self.connector.request_finished(request, list(request.block_ids))
            except Exception:
                logger.exception("connector.request_finished failed for %s", request.request_id)
                delay, params = False, None
            request.output_kv_transfer_params = params
        # a load from the store may still write into its blocks; the connector then holds
        # none (the store stage comes before the connector is consulted): one releases them
        if self.kv_store is not None and self.kv_store.request_finished(request.request_id):
            delay = True
        if delay and request.block_ids:
            self.delayed_free[request.request_id] = request
        else:
            self.block_manager.free_blocks(request)

    def poll_connector(self) -> None:
        """Pick up finished/failed async loads and the blocks the connector (and the KV
        store's loader) is done with."""
        if self.kv_store is not None:
            self.finish_store_loads()
        if self.connector is None:
            return
        loaded, failed = self.connector.get_finished_loading(), self.connector.get_failed_loading()
        if loaded or failed:
            self.finish_remote_loads(loaded, failed)
        for request_id in self.connector.get_finished_sending():
            request = self.delayed_free.pop(request_id, None)
            if request is not None:
                self.block_manager.free_blocks(request)

    def finish_remote_loads(self, loaded: set[str], failed: set[str]) -> None:
        """Async loads done: the request runs from its loaded tokens, or on failure
        recomputes from its local hit (its blocks stay, their contents are rewritten)."""
        for request_id in loaded | failed:
            request = self.waiting_for_remote.pop(request_id, None)
            if request is None:
                continue
            external = request.pending_external_tokens
            if request_id in loaded and request_id not in failed and not self.load_state(request):
                failed = failed | {request_id}
            if request_id in loaded and request_id not in failed:
                request.num_computed_tokens += external
                self.block_manager.cache_full_blocks(request)
            else:
                request.num_cached_tokens -= external
                request.metrics["received_tokens"] = 0
                if "pulled_tokens" in request.metrics:
                    request.metrics["pulled_tokens"] = 0
            request.pending_external_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)

    def load_state(self, request: Request) -> bool:
        """A hybrid model's loaded request: its slot takes the Mamba state that arrived with
        the KV (True); without one (or one not whole) it recomputes instead (False)."""
        if self.state_pool is None or self.connector is None or request.pending_external_tokens == 0:
            return True
        state = self.connector.take_received_state(request.request_id)
        if state is None or len(state) != self.state_pool.slot_bytes:
            logger.warning(
                "request %s: no whole Mamba state came with its KV; recomputing", request.request_id
            )
            return False
        self.state_pool.load_state(request.request_id, state)
        return True

    def remove(self, request: Request) -> None:
        """Take a request out of whichever queue holds it."""
        if request in self.running:
            self.running.remove(request)
        elif request.request_id in self.waiting_for_remote:
            del self.waiting_for_remote[request.request_id]
        elif request.request_id in self.waiting_for_store:
            del self.waiting_for_store[request.request_id]
        elif request in self.waiting:
            self.waiting.remove(request)

    def check_integrity(self) -> None:
        """Raise AssertionError if the block (and state slot) accounting differs from the
        blocks (and slots) held."""
        holders = [r for r in self.requests.values() if r.block_ids] + list(self.delayed_free.values())
        self.block_manager.check_integrity(holders)
        if self.state_pool is not None:
            admitted = [*self.running, *self.waiting_for_remote.values()]
            self.state_pool.check_integrity(r.request_id for r in admitted)
