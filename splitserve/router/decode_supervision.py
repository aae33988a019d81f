"""Supervision of a request's decode stream: the stream runs on a decode worker the router
picks; a worker that cannot be reached, dies mid-stream, or stalls (silent past the stall
timeout, its /health unanswered: router/stall.py) is taken out of rotation (a stalled one
is also sent an abort in the background), and the request moves to another decode worker:
retried when nothing was streamed yet, resumed from the prompt plus the tokens streamed
so far otherwise (router/migration.py). The client sees one stream. When no decode worker
is left to move to (a single decode worker, restarted by `up`), the stream waits for one to
come (back) into rotation, `resume_wait_s` at most over the whole stream, woken by the
pool's health change (`WorkerPool.wait_for_worker`), then moves there.

How a request runs on a chosen worker (decode alone, or P/D with a prefill worker) is
the caller's: `DecodeSupervisor` takes it as `run_on`, and the pick as `pick_decode`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable

import httpx

from splitserve.protocol.errors import APIError
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.router.metrics import ProxyMetrics
from splitserve.router.migration import StreamedSoFar, as_original, resumed_request
from splitserve.router.stall import ABORT_TIMEOUT_S, PROBE_TIMEOUT_S, DecodeStalled, watch_for_stall
from splitserve.router.workers import Worker, WorkerPool

logger = logging.getLogger(__name__)

# (request, workers already tried, the conversation's last decode worker) → a decode
# worker not tried yet, or None when none is left
PickDecode = Callable[[GenerateRequest, set[str], str | None], Worker | None]
# (decode worker, generate request) → its chunks: the request run with that worker decoding
RunOn = Callable[[Worker, GenerateRequest], AsyncIterator[dict]]

DEFAULT_RESUME_WAIT_S = 60.0


class DecodeSupervisor:
    def __init__(
        self,
        pool: WorkerPool,
        metrics: ProxyMetrics,
        http: httpx.AsyncClient,
        stall_timeout_s: float,
        pick_decode: PickDecode,
        run_on: RunOn,
        resume_wait_s: float = DEFAULT_RESUME_WAIT_S,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.http = http  # the control pool: stall probes and aborts
        self.stall_timeout_s = stall_timeout_s
        self.pick_decode = pick_decode
        self.run_on = run_on
        # how long, over a whole stream, it may wait for a decode worker to come (back) into
        # rotation when none is left to move to (0: it ends at once)
        self.resume_wait_s = resume_wait_s
        self._background: set[asyncio.Future] = set()  # aborts sent to stalled workers

    async def stream(
        self,
        request: GenerateRequest,
        hinted: str | None = None,
        on_finished: Callable[[Worker], None] | None = None,
    ) -> AsyncIterator[dict]:
        """The chunks of `request`, as one stream whatever happens to its decode workers;
        `on_finished(worker)` when `worker` has streamed its end."""
        base_id = request.request_id
        tried: set[str] = set()
        streamed = StreamedSoFar()
        attempt = request
        wait_deadline = asyncio.get_running_loop().time() + self.resume_wait_s
        while True:
            decode = self.pick_decode(request, tried, hinted)
            if decode is None and tried:  # every worker tried has failed: wait for one to come back
                decode = await self._wait_for_decode(request, hinted, wait_deadline)
            if decode is None:
                self.metrics.errors.labels("503").inc()
                raise APIError(503, "no decode worker is available", code="no_worker")
            attempt_id = base_id if not tried else f"{base_id}-retry{len(tried)}"
            tried.add(decode.url)
            before = len(streamed.token_ids)
            try:
                stream = self.run_on(decode, dataclasses.replace(attempt, request_id=attempt_id))
                with self.pool.lease(decode):
                    async with contextlib.aclosing(self._watched(decode, stream)) as chunks:
                        async for chunk in chunks:
                            streamed.add(chunk)
                            told = as_original(chunk, request, before)
                            self._count_resumed(told)
                            yield told
                if on_finished is not None:
                    on_finished(decode)
                return
            except APIError as exc:
                if exc.status != 503:  # 503: the worker is unreachable, died or stalled mid-stream
                    self.metrics.errors.labels(str(exc.status)).inc()
                    raise
                self.pool.report_failure(decode, exc.message)
                if isinstance(exc, DecodeStalled):
                    self.metrics.decode_stalls.inc()
                    self._abort_in_background(decode, attempt_id)
                resumed = resumed_request(request, streamed.token_ids) if streamed.token_ids else attempt
                if streamed.finished or resumed is None:
                    self.metrics.errors.labels(str(exc.status)).inc()
                    raise
                attempt = resumed
                self.metrics.retries.inc()
                logger.warning(
                    "resuming %s on another decode worker after %d tokens: %s",
                    base_id,
                    len(streamed.token_ids),
                    exc.message,
                )

    async def _wait_for_decode(
        self, request: GenerateRequest, hinted: str | None, deadline: float
    ) -> Worker | None:
        """A decode worker that came (back) into rotation before `deadline` (a restarted one
        may be one tried already: same URL, new process); None past it."""
        loop = asyncio.get_running_loop()
        while loop.time() < deadline:
            decode = self.pick_decode(request, set(), hinted)  # back since the last look
            if decode is not None:
                return decode
            self.metrics.resume_waits.inc()
            logger.warning(
                "no decode worker is available: waiting for one (%.0f s left)", deadline - loop.time()
            )
            await self.pool.wait_for_worker("decode", deadline - loop.time())
        return None

    def _count_resumed(self, chunk: dict) -> None:
        resumed = (chunk.get("metrics") or {}).get("resumed")
        if isinstance(resumed, dict):
            for source in ("reused", "pulled", "computed"):
                self.metrics.resumed_prompt_tokens.labels(source).inc(resumed[f"prompt_tokens_{source}"])

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    def _watched(self, decode: Worker, stream: AsyncIterator[dict]) -> AsyncIterator[dict]:
        """`stream`, ended with `DecodeStalled` when `decode` goes silent and stops
        answering its /health."""

        async def probe() -> bool:
            try:
                response = await self.http.get(f"{decode.url}/health", timeout=PROBE_TIMEOUT_S)
            except httpx.HTTPError:
                return False
            return response.status_code == 200

        return watch_for_stall(
            stream, self.stall_timeout_s, probe, self.metrics.decode_stall_probes.inc, decode.url
        )

    def _abort_in_background(self, decode: Worker, request_id: str) -> None:
        """Ask a stalled worker to drop the request, without waiting: it may never answer."""

        async def abort() -> None:
            with contextlib.suppress(httpx.HTTPError):
                await self.http.post(
                    f"{decode.url}/inference/v1/abort_requests",
                    json={"request_ids": [request_id]},
                    timeout=ABORT_TIMEOUT_S,
                )

        task = asyncio.ensure_future(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
