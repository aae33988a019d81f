"""`splitserve kvstore`: the KV store tier, a process of its own.

Blocks over ZeroMQ on `--kv-port` (wire.py, authenticated with the deployment's internal
token); `/health` and `/metrics` over HTTP on `--port`, behind the same internal-token
guard as every internal part.
"""

from __future__ import annotations

import argparse
import logging

from splitserve.runtime import access
from splitserve.runtime.drain import add_serving_arguments, serve_draining

GIB = 1 << 30


def _gigabytes(text: str) -> int:
    """'0.5' -> bytes (GiB, so that 1 is 2**30); positive."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in GiB: {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a size in GiB must be positive: {text!r}")
    return max(1, round(value * GIB))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8300, help="HTTP: /health and /metrics")
    parser.add_argument("--kv-port", type=int, default=8301, help="the store's block protocol (ZeroMQ)")
    parser.add_argument(
        "--kv-store-ram-gb", type=_gigabytes, default=4 * GIB, help="RAM tier budget in GiB (default 4)"
    )
    parser.add_argument("--kv-store-disk", default=None, help="directory of the disk tier (default: none)")
    parser.add_argument(
        "--kv-store-disk-gb",
        type=_gigabytes,
        default=None,
        help="disk tier budget in GiB (with --kv-store-disk)",
    )
    parser.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="publish which tier holds which block (KV events, medium CPU or DISK) here, e.g. tcp://*:5560",
    )
    parser.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        help="ZMQ ROUTER endpoint answering replay requests (default: the events endpoint's port + 1)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    add_serving_arguments(parser)
    access.add_internal_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import zmq
    from fastapi import FastAPI
    from fastapi.responses import Response
    from prometheus_client import CollectorRegistry, generate_latest

    from splitserve.config import KVEventsConfig
    from splitserve.kv_store.server import KVStoreServer, StoreCollector
    from splitserve.kv_store.tiers import TieredStore
    from splitserve.protocol.kv_events import replay_endpoint_for
    from splitserve.runtime.kv_events import KVEventPublisher

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if (args.kv_store_disk is None) != (args.kv_store_disk_gb is None):
        raise SystemExit("splitserve kvstore: --kv-store-disk and --kv-store-disk-gb go together")
    try:
        policy = access.internal_policy(args)
        events = args.kv_events_endpoint
        store = TieredStore(
            args.kv_store_ram_gb, args.kv_store_disk, args.kv_store_disk_gb or 0, record_events=bool(events)
        )
        publisher, replay = None, None
        if events:
            replay = args.kv_events_replay_endpoint or replay_endpoint_for(events)
            publisher = KVEventPublisher(KVEventsConfig(endpoint=events, replay_endpoint=replay))
        server = KVStoreServer(
            store, host=args.host, port=args.kv_port, token=access.internal_token(), publisher=publisher
        )
    except (OSError, ValueError, zmq.ZMQError) as exc:
        raise SystemExit(f"splitserve kvstore: {exc}") from exc
    registry = CollectorRegistry()
    registry.register(StoreCollector(server))
    app = FastAPI(title="splitserve kv store")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "kv_port": server.port}

    @app.get("/inference/v1/kv/events")
    async def kv_events() -> dict:
        """Where the store publishes which tier holds which block (the proxy's router
        follows it, as it does an engine's)."""
        return {"endpoint": events, "replay_endpoint": replay if events else None}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    logging.getLogger(__name__).info(
        "KV store: blocks on tcp://%s:%d, RAM %.2f GiB, disk %s",
        args.host,
        server.port,
        args.kv_store_ram_gb / GIB,
        f"{args.kv_store_disk} ({args.kv_store_disk_gb / GIB:.2f} GiB)" if args.kv_store_disk else "none",
    )
    try:
        serve_draining(
            access.AccessGuard(app, policy),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            drain_timeout_s=args.drain_timeout,
            max_in_flight=args.max_in_flight,
        )
    finally:
        server.close()
    return 0
