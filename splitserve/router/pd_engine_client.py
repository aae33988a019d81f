"""The P/D `EngineClient`: one generate request run across a prefill and a decode worker.

Push (default): the decode request goes first; the proxy reads decode's reservation (its
prefix-cache match already subtracted) and sends the prefill request with the decode
block IDs; prefill ships KV layer by layer while decode waits and streams as soon as the
last layer lands. Pull: prefill runs, holds its blocks and answers where they are; decode
then reads them.

Both workers see the same token IDs (rendered once by the proxy). A prefill that fails
makes decode compute the prompt itself (told at once in push mode); a decode worker that
fails before anything was streamed is taken out of rotation and the request is retried
on another one; one that fails or stalls mid-stream has the request resumed on another
one from the prompt plus the tokens streamed so far (router/decode_supervision.py).

Every request sent to a worker counts in that worker's load until it ends
(router/load.py), on top of what the worker last reported (`poll_load`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import NamedTuple

import httpx

from splitserve.protocol.engine_api import prompt_cached_tokens
from splitserve.protocol.engine_client import EngineClient
from splitserve.protocol.errors import APIError
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.kv_transfer import KVTransferParams, chunk_kv_transfer_params
from splitserve.protocol.pd_decision import (
    CostProfile,
    DecisionInputs,
    PDDecision,
    decide,
    threshold_decision,
)
from splitserve.router.attempt_timeline import AttemptClock, with_phases
from splitserve.router.decode_supervision import DecodeSupervisor
from splitserve.router.kv_index import KVBlockIndex, KVEventFeed, KVRoutingWeights, request_block_hashes
from splitserve.router.metrics import ProxyMetrics
from splitserve.router.pd_costs import CostCalibrator
from splitserve.router.pd_policy import ConversationHints, PDPolicy
from splitserve.router.pd_push_control import PushControl
from splitserve.router.prefill_report import (
    is_final,
    raise_if_transfer_failed,
    with_prefill,
    with_prefill_report,
)
from splitserve.router.routing import Router, RoutingPolicy
from splitserve.router.traffic import TrafficLog
from splitserve.router.worker_watch import WorkerWatch
from splitserve.router.workers import Worker, WorkerPool, WorkerRole
from splitserve.runtime.client_quota import kv_blocks_held
from splitserve.runtime.http_engine_client import HTTPEngineClient
from splitserve.runtime.http_pool import pooled_client

logger = logging.getLogger(__name__)


class PrefillFailed(RuntimeError):
    pass


class PrefillResult(NamedTuple):
    params: KVTransferParams  # where the KV is (pull) or how the push went
    cached_tokens: int  # prompt tokens the prefill worker did not compute (its prefix hits)
    metrics: dict  # its final chunk's per-request metrics (queue, time to its token)


class PDEngineClient(EngineClient):
    def __init__(
        self,
        pool: WorkerPool,
        policy: PDPolicy,
        metrics: ProxyMetrics | None = None,
        routing_weights: KVRoutingWeights | None = None,
        routing: RoutingPolicy = RoutingPolicy.CACHE_AWARE,
        cost_profile: CostProfile | None = None,
    ):
        self.pool = pool
        self.policy = policy
        self.metrics = metrics or ProxyMetrics()
        # which worker holds which block, from the engines' KV events (cache-aware routing)
        self.routing_weights = routing_weights or KVRoutingWeights()
        self.kv_index = KVBlockIndex()
        self.kv_feed = KVEventFeed(self.kv_index)
        self.router = Router(routing, self.kv_index, self.routing_weights)
        self.block_sizes = self.router.block_sizes  # per worker URL, from its KV events info
        self.conversations = ConversationHints()  # clients' conversation_id → decode worker
        self.traffic = TrafficLog()  # arrivals and lengths, for a planner
        # Control calls (reservations, health) get their own small pool: httpcore scans a
        # whole pool on every request, so the hundreds of long-lived generate streams live
        # in one pool per worker.
        self._http = pooled_client(read_timeout_s=None)
        self._clients: dict[str, HTTPEngineClient] = {}
        self.push_control = PushControl(self._http, policy, self.metrics)
        self.costs = CostCalibrator(cost_profile)  # the P/D decision's, measured or pinned
        self.watch = WorkerWatch(self._http, self.kv_feed, self.router, self.costs)
        self._releases: set[asyncio.Future] = set()  # pull holds being released on prefill
        self.decode_streams = DecodeSupervisor(
            pool,
            self.metrics,
            self._http,
            policy.stall_timeout_s,
            lambda request, tried, hinted: self._pick("decode", request, tried, hinted),
            self._run,
            policy.resume_wait_s,
        )

    def _client(self, worker: Worker) -> HTTPEngineClient:
        client = self._clients.get(worker.url)
        if client is None:
            client = self._clients[worker.url] = HTTPEngineClient(worker.url, name=f"{worker.role} worker")
        return client

    # ---- EngineClient ---------------------------------------------------------------
    def generate(self, request: GenerateRequest) -> AsyncIterator[dict]:
        return self._generate(request)

    def _send(self, worker: Worker, request: GenerateRequest) -> AsyncIterator[dict]:
        """`request` run on `worker`: the one place a request leaves the router."""
        return self._client(worker).generate(request)

    async def abort(self, request_ids: list[str]) -> None:
        for worker in self.pool.workers():
            with contextlib.suppress(APIError):
                await self._client(worker).abort(request_ids)

    async def check_health(self) -> bool:
        return self.pool.pick("decode") is not None

    async def close(self) -> None:
        await self.decode_streams.close()
        await asyncio.gather(*self._releases, return_exceptions=True)
        for client in self._clients.values():
            await client.close()
        await self._http.aclose()
        self.kv_feed.close()

    async def check_worker(self, worker: Worker) -> bool:
        """Healthy, and a P/D engine of the role its pool expects (router/worker_watch.py)."""
        return await self.watch.check(worker)

    def forget_worker(self, url: str) -> None:
        """A worker left the pool: its events, index entries and load report go."""
        self.watch.forget(url)

    async def poll_load(self, worker: Worker) -> None:
        await self.watch.poll_load(worker)

    def load_snapshot(self) -> dict[str, dict]:
        return self.watch.load_snapshot(self.pool)

    def _pick(
        self,
        role: WorkerRole,
        request: GenerateRequest,
        exclude: set[str] | frozenset[str] = frozenset(),
        hinted: str | None = None,
    ) -> Worker | None:
        """The worker of `role` the routing policy picks (router/routing.py); `hinted`:
        the conversation's last decode worker."""
        return self.router.pick(self.pool, role, request, exclude, hinted)

    def decision_inputs(self, decode: Worker, uncached_tokens: int) -> DecisionInputs:
        """What the P/D decision weighs for a prompt `decode` lacks `uncached_tokens` of:
        decode's streams and queue, and the shortest queue among the healthy prefill
        workers (the one the request would most likely get; picking it here would move
        round-robin and text-prefix state for a request that may not use it)."""
        decode_load = self.router.loads.load(decode.url)
        loads = self.router.loads
        prefill_queues = [
            loads.load(w.url).queued_prefill_tokens for w in self.pool.workers("prefill") if w.healthy
        ]
        return DecisionInputs(
            max(0, uncached_tokens),
            self.router.loads.decoding_streams(decode.url),
            decode_load.queued_prefill_tokens,
            min(prefill_queues, default=0),
        )

    def decide_path(self, inputs: DecisionInputs) -> PDDecision:
        """Prefill on a prefill worker or on decode, by `--pd-decision` (protocol/pd_decision.py)."""
        if self.policy.decision == "threshold":
            decision = threshold_decision(inputs, self.policy.min_prefill_tokens, self.costs.costs())
        else:
            decision = decide(inputs, self.costs.costs())
        logger.debug("P/D decision %s for %s", decision, inputs)
        return decision

    def cached_tokens(self, worker: Worker, request: GenerateRequest) -> int:
        """The leading prompt tokens `worker` holds, by the KV event index."""
        matched = self.kv_index.matched_blocks(worker.url, request_block_hashes(request))
        return matched * self.block_sizes.get(worker.url, 0)

    # ---- the flow -------------------------------------------------------------------
    async def _generate(self, request: GenerateRequest) -> AsyncIterator[dict]:
        conversation = request.conversation_id
        hinted = self.conversations.worker_of(conversation)

        def served(decode: Worker) -> None:
            self.conversations.remember(conversation, decode.url)

        # the client's KV-block budget (runtime/client_quota.py) is charged once per
        # request, before any worker is asked, and given back when the request ends
        observed = self.traffic.arrived(request)
        with kv_blocks_held(self._prompt_blocks(request, hinted)):
            chunks = self.decode_streams.stream(request, hinted, served)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    observed.saw(chunk)
                    yield chunk

    def _prompt_blocks(self, request: GenerateRequest, hinted: str | None) -> int:
        """The KV blocks the prompt takes on decode, at the block size of the conversation's
        decode worker, else of any decode worker (a deployment has one block size)."""
        tokens = request.token_ids
        decode = self.pool.workers("decode")
        url = hinted or (decode[0].url if decode else "")
        return math.ceil(len(tokens) / self.router.block_size(url))

    async def _run(self, decode: Worker, request: GenerateRequest) -> AsyncIterator[dict]:
        """`request` run with `decode` decoding: P/D, or decode alone when the P/D decision
        says so (`decide_path`). Its final chunk carries where the time to first token went
        (`metrics.phases`)."""
        clock = AttemptClock()
        self._count_prefix_hits(decode, request)
        tokens = request.token_ids
        prefill = None
        inputs = self.decision_inputs(decode, len(tokens) - self.cached_tokens(decode, request))
        if self.decide_path(inputs).remote:
            prefill = self._pick("prefill", request)
            if prefill is None and self.pool.workers("prefill"):
                self.metrics.fallbacks.labels("no_prefill_worker").inc()
        if prefill is None:
            self.metrics.requests.labels("decode_only").inc()
            stream = self._send(decode, request)
            clock.dispatch()
        elif self.policy.mode == "push":
            self.metrics.requests.labels("pd_push").inc()
            stream = self._push(decode, prefill, request, clock)
        else:
            self.metrics.requests.labels("pd_pull").inc()
            stream = self._pull(decode, prefill, request, clock)
        num_tokens = len(tokens)
        # decode computes the prompt when no prefill worker does (only the last token else)
        computed = num_tokens - self.cached_tokens(decode, request) if prefill is None else 1
        blocks = math.ceil(num_tokens / self.router.block_size(decode.url))
        sent = time.monotonic()
        first = True
        try:
            with self.router.loads.tracking(decode.url, max(1, computed), blocks) as load:
                async for chunk in stream:
                    if first:
                        first = False
                        clock.first_chunk()
                        load.prefilled()
                        ttft = time.monotonic() - sent
                        self.metrics.ttft.observe(ttft)
                        self.costs.observe_first_token(inputs, prefill is not None, ttft)
                        raise_if_transfer_failed(chunk)
                    if is_final(chunk):
                        chunk = with_phases(chunk, clock.phases(chunk))
                    yield chunk
        finally:
            await stream.aclose()

    def _count_prefix_hits(self, worker: Worker, request: GenerateRequest) -> None:
        hashes = request_block_hashes(request)
        self.metrics.prefix_query_blocks.inc(len(hashes))
        self.metrics.prefix_hit_blocks.inc(self.kv_index.matched_blocks(worker.url, hashes))

    def _prefill_body(
        self, request: GenerateRequest, kv_transfer_params: KVTransferParams
    ) -> GenerateRequest:
        return dataclasses.replace(
            request,
            request_id=f"{request.request_id}-prefill",
            sampling_params=dataclasses.replace(request.sampling_params, max_tokens=1),
            kv_transfer_params=kv_transfer_params,
        )

    async def _run_prefill(self, prefill: Worker, request: GenerateRequest) -> PrefillResult:
        """Run the prefill request; its kv_transfer_params and cached tokens, or PrefillFailed."""
        started = time.monotonic()
        final: dict = {}
        computed = len(request.token_ids) - self.cached_tokens(prefill, request)
        with self.pool.lease(prefill), self.router.loads.tracking(prefill.url, computed, 0):
            try:
                async for chunk in self._send(prefill, request):
                    final = chunk
            except APIError as exc:
                if exc.status >= 500:
                    self.pool.report_failure(prefill, exc.message)
                raise PrefillFailed(f"prefill on {prefill.url} failed: {exc.message}") from exc
        params = chunk_kv_transfer_params(final)
        if params.kv_transfer_error:
            raise PrefillFailed(f"prefill on {prefill.url} could not ship its KV: {params.kv_transfer_error}")
        self.metrics.prefill_time.observe(time.monotonic() - started)
        metrics = final.get("metrics")
        return PrefillResult(
            params, prompt_cached_tokens(final) or 0, metrics if isinstance(metrics, dict) else {}
        )

    async def _push(
        self, decode: Worker, prefill: Worker, request: GenerateRequest, clock: AttemptClock
    ) -> AsyncIterator[dict]:
        """Decode's request and prefill's start together: prefill computes while decode
        reserves, and the reservation follows it (`_send_push_target`). Bidirectional with a
        prefix decode holds: prefill waits for the reservation, whose prefix offer it pulls
        instead of computing."""
        request_id = request.request_id
        clock.dispatch()
        wait_for_kv = KVTransferParams(do_remote_prefill=True)
        stream = self._send(decode, dataclasses.replace(request, kv_transfer_params=wait_for_kv))
        first_task = asyncio.ensure_future(anext(stream))
        prefill_task: asyncio.Future | None = None
        prefill_done_at: list[float] = []
        prefill_report: dict = {}
        concurrent = not (self.policy.bidirectional and self._may_lend(decode, request))

        def start_prefill(kv: KVTransferParams) -> asyncio.Future:
            prefill_body = self._prefill_body(request, kv)
            run = self._push_prefill(
                decode, prefill, prefill_body, request_id, prefill_done_at, prefill_report, clock
            )
            return asyncio.ensure_future(run)

        try:
            if concurrent:
                pending = KVTransferParams(
                    do_remote_decode=True,
                    transfer_mode="push",
                    remote_request_id=request_id,
                    push_target_pending=True,
                )
                prefill_task = start_prefill(pending)
            reservation = await self.push_control.reserve(decode, request_id, first_task)
            if concurrent:
                assert prefill_task is not None
                target = self.push_control.push_params(reservation) if reservation is not None else None
                await self.push_control.send_target(
                    decode, prefill, request_id, target, prefill_task, prefill_report
                )
            else:
                clock.reservation_answered()
                if reservation is not None:
                    prefill_task = start_prefill(self.push_control.push_params(reservation))
            first = await first_task
            if prefill_done_at:
                self.metrics.handoff_time.observe(max(0.0, time.monotonic() - prefill_done_at[0]))
            yield await with_prefill_report(first, prefill_task, prefill_report)
            async for chunk in stream:
                yield await with_prefill_report(chunk, prefill_task, prefill_report)
        finally:
            for task in (first_task, prefill_task):
                if task is not None and not task.done():
                    task.cancel()
            await asyncio.gather(
                *(t for t in (first_task, prefill_task) if t is not None), return_exceptions=True
            )
            await stream.aclose()

    def _may_lend(self, decode: Worker, request: GenerateRequest) -> bool:
        """May `decode` hold a prefix of the prompt to lend: by the KV event index, or as
        the conversation's last decode worker (its turn's events may not be indexed yet)."""
        hinted = self.conversations.worker_of(request.conversation_id)
        return hinted == decode.url or self.cached_tokens(decode, request) > 0

    async def _push_prefill(
        self,
        decode: Worker,
        prefill: Worker,
        request: GenerateRequest,
        request_id: str,
        done_at: list[float],
        params_out: dict,
        clock: AttemptClock,
    ) -> None:
        try:
            result = await self._run_prefill(prefill, request)
            clock.prefill_metrics = result.metrics
            params_out.update(result.params.to_wire(), cached_tokens=result.cached_tokens)
            done_at.append(time.monotonic())
        except PrefillFailed as exc:
            await self.push_control.prefill_failed(decode, request_id, str(exc))

    async def _pull(
        self, decode: Worker, prefill: Worker, request: GenerateRequest, clock: AttemptClock
    ) -> AsyncIterator[dict]:
        kv: KVTransferParams | None = None
        prefill_cached = 0
        prefill_done = 0.0
        clock.dispatch()
        try:
            hold = KVTransferParams(do_remote_decode=True, transfer_mode="pull")
            kv, prefill_cached, clock.prefill_metrics = await self._run_prefill(
                prefill, self._prefill_body(request, hold)
            )
            prefill_done = time.monotonic()
            if not kv.remote_block_ids:
                raise PrefillFailed(f"prefill on {prefill.url} returned no blocks to pull")
        except PrefillFailed as exc:
            self.metrics.prefill_failures.inc()
            self.metrics.fallbacks.labels("prefill_failed").inc()
            logger.warning("%s; decode %s computes the prompt", exc, decode.url)
            kv = None
        decode_body = dataclasses.replace(request, kv_transfer_params=kv) if kv else request
        report = dataclasses.replace(kv, prompt_token_ids=None).to_wire() if kv else {}
        if kv:
            report["cached_tokens"] = prefill_cached
        first = True
        try:
            async for chunk in self._send(decode, decode_body):
                if first and prefill_done:
                    self.metrics.handoff_time.observe(time.monotonic() - prefill_done)
                first = False
                yield with_prefill(chunk, report)
        finally:
            if kv is not None and kv.remote_request_id:
                # read by now, or never will be (the client left, decode failed or
                # recomputed): the hold goes now, not at its TTL
                self._release_hold_in_background(prefill, kv.remote_request_id)

    def _release_hold_in_background(self, prefill: Worker, request_id: str) -> None:
        async def release() -> None:
            with contextlib.suppress(httpx.HTTPError):
                await self._http.post(
                    f"{prefill.url}/inference/v1/kv/release_hold",
                    json={"request_id": request_id},
                    timeout=5.0,
                )

        task = asyncio.ensure_future(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
