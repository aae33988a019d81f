"""Each worker's load as the cache-aware router weighs it: prompt tokens queued for prefill
and KV blocks held by decoding requests.

Workers report both (`GET /inference/v1/stats`: `num_waiting_prefill_tokens`,
`num_running_decode_blocks`), polled every `--load-interval`. A report is already old when
it lands, so the router adds its own accounting of what it sent (Dynamo's and llm-d's
answer to the same problem): a request the router sent counts on its worker from the
moment it is sent, as its uncached prompt tokens until its first token and as its prompt's
blocks until it ends, for as long as no report can show it (one polled at least
`REPORT_LAG_S` after the send). A report that does show it is corrected for what the
router has seen since: a prefill it saw finish moves from queued tokens to decode blocks,
a request it saw end leaves both. A burst of requests therefore spreads over the pool
before any report shows it, and a worker that just finished one is not left looking busy
until the next poll. Without reports (an engine that does not publish the fields, or a
failed poll) the load is the router's own accounting alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from splitserve.router.workers import Worker, WorkerPool

# A request sent this long before a poll began is taken to be in that poll's report (the
# engine counts a request as soon as its HTTP handler has accepted it).
REPORT_LAG_S = 0.1


class WorkerLoad(NamedTuple):
    queued_prefill_tokens: int
    running_decode_blocks: int


@dataclass
class _Sent:
    prefill_tokens: int
    decode_blocks: int
    sent_at: float
    prefilled_at: float | None = None
    ended_at: float | None = None


@dataclass
class _WorkerState:
    report: WorkerLoad | None = None
    polled_at: float = float("-inf")


class SentRequest:
    """One request the router sent to a worker: tell the tracker when its prefill is done;
    leaving `LoadTracker.tracking` tells it the request ended."""

    def __init__(self, tracker: LoadTracker, url: str, key: int) -> None:
        self._tracker, self._url, self._key = tracker, url, key

    def prefilled(self) -> None:
        self._tracker.mark_prefilled(self._url, self._key)


class LoadTracker:
    def __init__(self, report_lag_s: float = REPORT_LAG_S, clock: Callable[[], float] = time.monotonic):
        self.report_lag_s = report_lag_s
        self.clock = clock
        self._lock = threading.Lock()
        self._workers: dict[str, _WorkerState] = {}
        self._sent: dict[str, dict[int, _Sent]] = {}  # requests in flight, by key
        self._ended: dict[str, list[_Sent]] = {}  # requests ended since the last poll began
        self._keys = itertools.count()

    def report(self, url: str, load: WorkerLoad | None, polled_at: float) -> None:
        """What `url` reported in answer to a poll sent at `polled_at` (None: no report)."""
        with self._lock:
            self._workers[url] = _WorkerState(load, polled_at if load is not None else float("-inf"))
            ended = self._ended.get(url, [])
            self._ended[url] = [
                sent for sent in ended if sent.ended_at is not None and sent.ended_at > polled_at
            ]

    def forget(self, url: str) -> None:
        """A worker left the pool: its last report goes (requests still running there end
        as usual); a worker added again under the URL starts from its next report."""
        with self._lock:
            self._workers.pop(url, None)
            self._ended.pop(url, None)

    @contextlib.contextmanager
    def tracking(self, url: str, prefill_tokens: int, decode_blocks: int) -> Iterator[SentRequest]:
        """Count a request sent to `url` (its prompt tokens the worker will compute, the
        blocks it will hold while decoding) until the block ends."""
        key = next(self._keys)
        with self._lock:
            self._sent.setdefault(url, {})[key] = _Sent(prefill_tokens, decode_blocks, self.clock())
        try:
            yield SentRequest(self, url, key)
        finally:
            self._finish(url, key)

    def mark_prefilled(self, url: str, key: int) -> None:
        with self._lock:
            sent = self._sent.get(url, {}).get(key)
            if sent is not None and sent.prefilled_at is None:
                sent.prefilled_at = self.clock()

    def _finish(self, url: str, key: int) -> None:
        with self._lock:
            sent = self._sent.get(url, {}).pop(key, None)
            # the last report, or one already under way, may still show it (kept until the
            # next report; a worker never polled keeps nothing)
            if sent is not None and url in self._workers:
                sent.ended_at = self.clock()
                self._ended.setdefault(url, []).append(sent)

    def _in_report(self, sent: _Sent, state: _WorkerState) -> bool:
        return state.report is not None and sent.sent_at <= state.polled_at - self.report_lag_s

    def load(self, url: str) -> WorkerLoad:
        """The worker's last report, corrected by what the router sent and saw since."""
        with self._lock:
            state = self._workers.get(url) or _WorkerState()
            queued, decoding = state.report or WorkerLoad(0, 0)
            for sent in self._ended.get(url, ()):
                if not self._in_report(sent, state):
                    continue
                if sent.prefilled_at is None or sent.prefilled_at > state.polled_at:
                    queued -= sent.prefill_tokens  # the report shows it queued; it ended since
                else:
                    decoding -= sent.decode_blocks  # the report shows it decoding; it ended since
            for sent in self._sent.get(url, {}).values():
                if not self._in_report(sent, state):
                    queued += sent.prefill_tokens if sent.prefilled_at is None else 0
                    decoding += sent.decode_blocks
                elif sent.prefilled_at is not None and sent.prefilled_at > state.polled_at:
                    queued -= sent.prefill_tokens  # reported queued; decoding since
                    decoding += sent.decode_blocks
            return WorkerLoad(max(0, queued), max(0, decoding))

    def decoding_streams(self, url: str) -> int:
        """Requests this router sent to `url` that are past their first token and still
        running (the streams a prefill on that worker would stall). Other proxies'
        streams on a shared worker are not counted."""
        with self._lock:
            return sum(1 for sent in self._sent.get(url, {}).values() if sent.prefilled_at is not None)

    def snapshot(self, url: str) -> dict:
        with self._lock:
            state = self._workers.get(url)
            reported = state is not None and state.report is not None
        return {**self.load(url)._asdict(), "load_reported": reported}


async def load_loop(pool: WorkerPool, poll: Callable[[Worker], Awaitable[None]], interval_s: float) -> None:
    """Poll every healthy worker's load each `interval_s`, concurrently, until cancelled."""
    while True:
        workers = [w for w in pool.workers() if w.healthy]
        await asyncio.gather(*(poll(w) for w in workers), return_exceptions=True)
        await asyncio.sleep(interval_s)
