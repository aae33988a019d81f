"""What the proxy keeps learning about its P/D workers, apart from the requests it runs:
whether each is healthy and an engine of the role its pool expects, the KV events it
publishes (followed into the routing index), and the load it reports. A worker that
leaves the pool is forgotten, so one registered again under its URL is checked afresh."""

from __future__ import annotations

import logging

import httpx

from splitserve.protocol.kv_events import connect_address
from splitserve.router.kv_index import KVEventFeed
from splitserve.router.load import WorkerLoad
from splitserve.router.pd_costs import CostCalibrator
from splitserve.router.routing import Router
from splitserve.router.workers import Worker, WorkerPool

logger = logging.getLogger(__name__)


class WorkerWatch:
    def __init__(
        self,
        http: httpx.AsyncClient,
        kv_feed: KVEventFeed,
        router: Router,
        costs: CostCalibrator | None = None,
    ) -> None:
        self.http = http
        self.costs = costs  # the P/D decision's: a prefill worker's steps tell its cost per token
        self.kv_feed = kv_feed
        self.router = router
        self.block_sizes = router.block_sizes  # per worker URL, from its KV events info
        self._role_checked: set[str] = set()

    async def check(self, worker: Worker) -> bool:
        """Healthy, and a P/D engine of the role its pool expects: a collocated or
        prefill engine in the decode pool would silently answer wrongly."""
        try:
            response = await self.http.get(f"{worker.url}/health", timeout=5.0)
            if response.status_code != 200:
                return False
            if worker.url not in self._role_checked:
                info = await self.http.get(f"{worker.url}/inference/v1/kv/info", timeout=5.0)
                role = info.json().get("role") if info.status_code == 200 else None
                if role != worker.role:
                    logger.error(
                        "%s is not a %s engine (its role: %s)", worker.url, worker.role, role or "none"
                    )
                    return False
                await self._watch_kv_events(worker)
                self._role_checked.add(worker.url)
        except (httpx.HTTPError, ValueError):
            return False
        return True

    def forget(self, url: str) -> None:
        """A worker left the pool (WorkerPool.remove): its KV-event subscription ends, the
        index forgets its blocks, its load report goes, and a worker registered again under
        the URL is checked (role, events) afresh. Blocks on the feed's thread briefly."""
        self._role_checked.discard(url)
        self.kv_feed.unwatch(url)
        self.block_sizes.pop(url, None)
        self.router.loads.forget(url)
        if self.costs is not None:
            self.costs.forget(url)

    async def poll_load(self, worker: Worker) -> None:
        """Ask the worker for its load (`GET /inference/v1/stats`) and hand it to the
        router; an engine that does not report it leaves the router's own accounting."""
        polled_at = self.router.loads.clock()
        load: WorkerLoad | None = None
        try:
            response = await self.http.get(f"{worker.url}/inference/v1/stats", timeout=2.0)
            stats = response.json() if response.status_code == 200 else {}
            if self.costs is not None and isinstance(stats, dict):
                self.costs.observe_stats(worker.url, worker.role, stats)
            load = WorkerLoad(
                int(stats["num_waiting_prefill_tokens"]), int(stats["num_running_decode_blocks"])
            )
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            load = None
        self.router.loads.report(worker.url, load, polled_at)

    def load_snapshot(self, pool: WorkerPool) -> dict[str, dict]:
        """Per worker URL, the load the router weighs (for /workers)."""
        loads = self.router.loads
        return {
            w.url: {**loads.snapshot(w.url), "decoding_streams": loads.decoding_streams(w.url)}
            for w in pool.workers()
        }

    async def watch_store(self, url: str) -> bool:
        """Follow a KV store tier's events (which of its tiers holds which block; `splitserve
        kvstore` answers /inference/v1/kv/events) into the routing index; False while it
        does not answer (its feed, once started, follows its restarts itself)."""
        try:
            response = await self.http.get(f"{url}/inference/v1/kv/events", timeout=5.0)
            info = response.json() if response.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return False
        if not isinstance(info, dict) or not info.get("endpoint"):
            return False
        host = httpx.URL(url).host
        replay = info.get("replay_endpoint")
        self.kv_feed.index.add_store(url)
        self.kv_feed.watch(
            url, connect_address(info["endpoint"], host), replay and connect_address(replay, host)
        )
        return True

    def forget_store(self, url: str) -> None:
        """The KV store at `url` is gone for good (replaced by another): its events are
        no longer followed and the routing index credits none of its blocks. Blocks on the
        feed's thread briefly."""
        self.kv_feed.unwatch(url)
        self.kv_feed.index.remove_store(url)

    async def _watch_kv_events(self, worker: Worker) -> None:
        """Follow the worker's KV events when it publishes them (engines started with
        --kv-events-endpoint answer /inference/v1/kv/events)."""
        response = await self.http.get(f"{worker.url}/inference/v1/kv/events", timeout=5.0)
        if response.status_code != 200:
            return
        info = response.json()
        if not info.get("endpoint"):
            return
        host = httpx.URL(worker.url).host
        replay = info.get("replay_endpoint")
        self.block_sizes[worker.url] = int(info.get("block_size") or 0)
        self.kv_feed.watch(
            worker.url, connect_address(info["endpoint"], host), replay and connect_address(replay, host)
        )
