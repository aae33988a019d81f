"""Continuous batching with a per-step token budget.

Each step: running requests first (decodes, and prefills already in flight), then
waiting requests are admitted in arrival order, their prompts chunked to fill the rest
of the budget. When blocks run out the most recently admitted running request is
preempted: its blocks are freed and it is recomputed later (its prefix usually comes
back from the prefix cache).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from splitserve.config import SchedulerConfig
from splitserve.engine.block_manager import BlockManager, cdiv
from splitserve.engine.request import Request, RequestStatus
from splitserve.kv.connector import KVConnector


class ScheduledRequest(NamedTuple):
    request: Request
    position_start: int  # tokens already computed before this step
    num_tokens: int  # tokens computed this step


class SchedulerOutput(NamedTuple):
    scheduled: list[ScheduledRequest]
    num_tokens: int
    preempted: list[Request]
    too_long: list[Request]  # can never fit the KV cache: finish with "length"


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        connector: KVConnector | None = None,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_remote: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_runnable(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        too_long: list[Request] = []
        bm = self.block_manager

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
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
            item = self._admit(request, budget)
            if item is None:
                break
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.waiting_for_remote[request.request_id] = request
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(item)
            budget -= item.num_tokens
        num_tokens = self.config.max_num_batched_tokens - budget
        return SchedulerOutput(scheduled, num_tokens, preempted, too_long)

    def _admit(self, request: Request, budget: int) -> ScheduledRequest | None:
        bm = self.block_manager
        computed_blocks: list[int] = []
        if not request.block_ids:  # fresh or preempted (a failed remote load keeps its blocks)
            computed_blocks = bm.get_computed_blocks(request)
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
        return ScheduledRequest(request, num_computed, num_new)

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
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish_remote_loads(self, loaded: set[str], failed: set[str]) -> None:
        """Async loads done: the request runs from its loaded tokens, or on failure
        recomputes from its local hit (its blocks stay, their contents are rewritten)."""
        for request_id in loaded | failed:
            request = self.waiting_for_remote.pop(request_id, None)
            if request is None:
                continue
            external = request.pending_external_tokens
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

    def remove(self, request: Request) -> None:
        """Take a request out of whichever queue holds it."""
        if request in self.running:
            self.running.remove(request)
        elif request.request_id in self.waiting_for_remote:
            del self.waiting_for_remote[request.request_id]
        elif request in self.waiting:
            self.waiting.remove(request)
