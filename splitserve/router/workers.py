"""The prefill and decode worker pools the proxy routes over: least-loaded picks, health.

A worker that fails a request or a health check leaves the rotation until a later health
check passes. Load is the proxy's own count of requests in flight on each worker. A stream
left without a worker can wait for one to come (back) into rotation (`wait_for_worker`:
woken by the health change itself, never by polling).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

WorkerRole = Literal["prefill", "decode"]


@dataclass
class Worker:
    url: str
    role: WorkerRole
    healthy: bool = True
    in_flight: int = 0
    served: int = 0
    failures: int = 0

    def snapshot(self) -> dict:
        return {
            "url": self.url,
            "role": self.role,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "served": self.served,
            "failures": self.failures,
        }


class WorkerPool:
    """`allow_no_decode`: the pool starts empty and workers join later (`add`, as a Ray
    Serve deployment brings them up); until a decode worker joins, requests get 503."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], *, allow_no_decode: bool = False):
        if not decode_urls and not allow_no_decode:
            raise ValueError("at least one decode worker is needed")
        self._lock = threading.Lock()
        self._workers: list[Worker] = [Worker(u.rstrip("/"), "prefill") for u in prefill_urls]
        self._workers += [Worker(u.rstrip("/"), "decode") for u in decode_urls]
        # waiters for a worker of a role to come into rotation: (role, their loop, event)
        self._waiters: list[tuple[WorkerRole, asyncio.AbstractEventLoop, asyncio.Event]] = []

    def workers(self, role: WorkerRole | None = None) -> list[Worker]:
        return [w for w in self._workers if role is None or w.role == role]

    def add(self, url: str, role: WorkerRole) -> Worker:
        """Join `url` to the `role` pool (no-op when it is there already); the health loop
        checks it like any other worker."""
        url = url.rstrip("/")
        with self._lock:
            for worker in self._workers:
                if worker.url == url and worker.role == role:
                    return worker
            worker = Worker(url, role)
            self._workers = [*self._workers, worker]  # a new list: readers iterate the old one
        logger.warning("%s worker %s joined", role, url)
        self._wake(role)
        return worker

    def remove(self, url: str) -> bool:
        """Take `url` out of its pool for good (its requests in flight finish or fail as
        they would); whether it was there."""
        url = url.rstrip("/")
        with self._lock:
            kept = [w for w in self._workers if w.url != url]
            removed, self._workers = len(kept) != len(self._workers), kept
        if removed:
            logger.warning("worker %s left", url)
        return removed

    def pick(
        self,
        role: WorkerRole,
        exclude: set[str] | frozenset[str] = frozenset(),
        cost: Callable[[Worker], float] | None = None,
    ) -> Worker | None:
        """The healthy worker of `role` with the lowest `cost` (when given), then the
        fewest requests in flight, then the one that served fewest, so equal loads rotate."""
        with self._lock:
            candidates = [w for w in self._workers if w.role == role and w.healthy and w.url not in exclude]
            if not candidates:
                return None
            return min(candidates, key=lambda w: (cost(w) if cost else 0.0, w.in_flight, w.served))

    @contextlib.contextmanager
    def lease(self, worker: Worker) -> Iterator[Worker]:
        with self._lock:
            worker.in_flight += 1
            worker.served += 1
        try:
            yield worker
        finally:
            with self._lock:
                worker.in_flight -= 1

    def report_failure(self, worker: Worker, reason: str) -> None:
        with self._lock:
            worker.failures += 1
            was_healthy, worker.healthy = worker.healthy, False
        if was_healthy:
            logger.warning("%s worker %s out of rotation: %s", worker.role, worker.url, reason)

    def set_health(self, worker: Worker, healthy: bool) -> None:
        with self._lock:
            changed = worker.healthy != healthy
            worker.healthy = healthy
        if changed:
            state = "back in rotation" if healthy else "out of rotation (health check failed)"
            logger.warning("%s worker %s %s", worker.role, worker.url, state)
        if changed and healthy:
            self._wake(worker.role)

    async def wait_for_worker(self, role: WorkerRole, timeout_s: float) -> bool:
        """Wait until a worker of `role` comes (back) into rotation, at most `timeout_s`;
        whether one did. Healthy workers already there do not count: the caller has
        found none of them usable."""
        event = asyncio.Event()
        waiter = (role, asyncio.get_running_loop(), event)
        with self._lock:
            self._waiters.append(waiter)
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                await event.wait()
            return True
        except TimeoutError:
            return False
        finally:
            with self._lock:
                self._waiters.remove(waiter)

    def _wake(self, role: WorkerRole) -> None:
        """Wake the waiters for `role` (health checks may run on another thread or loop)."""
        with self._lock:
            waiters = [(loop, event) for r, loop, event in self._waiters if r == role]
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # that loop has closed
                loop.call_soon_threadsafe(event.set)

    def snapshot(self) -> list[dict]:
        with self._lock:
            return [w.snapshot() for w in self._workers]


async def check_all(pool: WorkerPool, check: Callable[[Worker], Awaitable[bool]]) -> None:
    """Run one health check of every worker, concurrently."""
    workers = pool.workers()
    results = await asyncio.gather(*(check(w) for w in workers), return_exceptions=True)
    for worker, result in zip(workers, results, strict=True):
        pool.set_health(worker, result is True)


async def health_loop(
    pool: WorkerPool, check: Callable[[Worker], Awaitable[bool]], interval_s: float
) -> None:
    """Check every worker each `interval_s` until cancelled."""
    while True:
        await check_all(pool, check)
        await asyncio.sleep(interval_s)
