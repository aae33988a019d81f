"""`--kv-store HOST:PORT` on `splitserve engine` and `serve`: the connector to the KV store
tier (engine/kv_store_client.py) and its counters on the engine's /metrics."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterator
from typing import TYPE_CHECKING

from fastapi import Request
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from splitserve.protocol.errors import APIError
from splitserve.runtime.http_edge import read_json_body

if TYPE_CHECKING:
    from fastapi import FastAPI

    from splitserve.config import EngineConfig
    from splitserve.engine.kv_store_client import KVStoreClient

PREFIX = "splitserve_kv_store_client"


def add_kv_store_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-store",
        default=None,
        metavar="HOST:PORT",
        help="a `splitserve kvstore`'s block port: evicted prefix-cache blocks are offloaded "
        "there and a prompt's missing leading blocks loaded from it (--role both, prefill or decode)",
    )
    parser.add_argument(
        "--kv-store-offload-queue",
        type=int,
        default=1024,
        help="blocks waiting to be offloaded at most; past it an evicted block is dropped (counted)",
    )
    parser.add_argument(
        "--kv-store-timeout",
        type=float,
        default=0.5,
        help="seconds a lookup waits for the store (it is then left alone for a cool-down)",
    )


def parse_address(text: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) -> (host, port); ValueError naming --kv-store."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--kv-store needs HOST:PORT, not {text!r}")
    return host.strip("[]"), int(port)


STORE_ROLES = ("both", "prefill", "decode")


def make_kv_store_client(
    args: argparse.Namespace, config: EngineConfig, token: str | None
) -> KVStoreClient | None:
    """The store client `--kv-store` asks for (None without it); ValueError for flags it
    cannot run with."""
    if not args.kv_store:
        return None
    host, port = parse_address(args.kv_store)
    if config.role not in STORE_ROLES:
        raise ValueError(f"--kv-store runs on a --role both, prefill or decode engine, not {config.role}")
    if not config.cache.enable_prefix_caching:
        raise ValueError("--kv-store needs the prefix cache (it offloads what the cache evicts)")
    if args.kv_store_offload_queue < 1:
        raise ValueError(f"--kv-store-offload-queue must be positive, not {args.kv_store_offload_queue}")
    if not args.kv_store_timeout > 0:
        raise ValueError(f"--kv-store-timeout must be positive, not {args.kv_store_timeout}")
    from splitserve.engine.kv_store_client import KVStoreClient  # torch: only engines pay for it

    return KVStoreClient(
        host, port, token, timeout_s=args.kv_store_timeout, queue_blocks=args.kv_store_offload_queue
    )


class KVStoreClientCollector(Collector):
    """The store client's counters, read when scraped."""

    def __init__(self, client: KVStoreClient) -> None:
        self.client = client

    def collect(self) -> Iterator[Metric]:
        s = self.client.stats
        counters = [
            ("lookups", "Prompts looked up in the KV store.", s.lookups),
            (
                "lookup_errors",
                "Lookups the KV store did not answer (then left alone a while).",
                s.lookup_errors,
            ),
            ("hit_blocks", "Blocks the KV store held for a prompt, past the local prefix hit.", s.hit_blocks),
            ("loads", "Prompts whose leading blocks loaded from the KV store.", s.loads),
            ("loaded_blocks", "Blocks loaded from the KV store into the pool.", s.loaded_blocks),
            ("loaded_bytes", "KV bytes loaded from the KV store.", s.loaded_bytes),
            ("failed_loads", "Loads that failed or were refused (the prompt recomputes).", s.failed_loads),
            (
                "load_seconds",
                "Seconds from a load's admission to its blocks in the pool, summed.",
                s.load_seconds,
            ),
            ("offered_blocks", "Blocks the prefix cache evicted.", s.offered_blocks),
            ("offloaded_blocks", "Evicted blocks the KV store took.", s.offloaded_blocks),
            ("offloaded_bytes", "KV bytes offloaded to the KV store.", s.offloaded_bytes),
            ("offload_dropped_full", "Evicted blocks dropped: the offload queue was full.", s.dropped_full),
            (
                "offload_dropped_down",
                "Evicted blocks dropped: the KV store was not answering.",
                s.dropped_down,
            ),
            ("offload_failed", "Offloaded blocks the KV store did not take.", s.offload_failed),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        by_tier = CounterMetricFamily(
            f"{PREFIX}_loaded_blocks_by_tier",
            "Blocks loaded, by the store tier that held them.",
            labels=["tier"],
        )
        for tier, count in sorted(dict(s.tiers).items()):  # a copy: the loader thread adds tiers
            by_tier.add_metric([tier], count)
        yield by_tier
        yield GaugeMetricFamily(
            f"{PREFIX}_offload_queue_depth",
            "Evicted blocks waiting to be offloaded.",
            self.client.offload_queue_depth,
        )


def install_kv_store(app: FastAPI, client: KVStoreClient | None) -> None:
    """With a store client: its counters on the app's /metrics, and
    `/inference/v1/kv/store`, where the store is (GET) and, for a deployment whose store
    was replaced elsewhere (Ray), where it is now (POST `{"address": "HOST:PORT"}`; an
    internal endpoint, like every engine route)."""
    if client is None:
        return
    metrics = getattr(app.state, "metrics", None)
    if metrics is not None:
        metrics.registry.register(KVStoreClientCollector(client))

    @app.get("/inference/v1/kv/store")
    async def store_address() -> dict:
        return {"address": client.address}

    @app.post("/inference/v1/kv/store")
    async def move_store(raw: Request) -> dict:
        body = await read_json_body(raw, 4096)
        address = body.get("address") if isinstance(body, dict) else None
        if not isinstance(address, str):
            raise APIError(400, 'expected {"address": "HOST:PORT"}', param="address")
        try:
            host, port = parse_address(address)
        except ValueError as exc:
            raise APIError(400, str(exc), param="address") from None
        await asyncio.to_thread(client.retarget, host, port)  # waits for a call in flight
        return {"address": client.address}
