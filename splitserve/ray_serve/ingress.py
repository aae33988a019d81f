"""The Ray deployment's ingress: the P/D proxy (`router/`), in process, behind Serve's HTTP
proxy, with its worker pools filled by the tier replicas as Serve brings them up.

Tier replicas call `register` on every Serve health check (a heartbeat) and `deregister`
when Serve tears them down; a worker whose heartbeats stop (its replica died) leaves
after `STALE_S`. The router's own health checks, routing, retries and stream migration
run unchanged: a dead worker is out of rotation at its first failed request or check,
long before it is dropped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from splitserve.protocol.access import API_KEY_ENV, OPEN_WITH_FLAG, AccessGuard, AccessPolicy
from splitserve.protocol.errors import error_body
from splitserve.router.app import create_proxy_app
from splitserve.router.pd_engine_client import PDEngineClient
from splitserve.router.pd_policy import PDPolicy
from splitserve.router.workers import WorkerPool, WorkerRole

logger = logging.getLogger(__name__)

STALE_S = 10.0  # heartbeats come every Serve health check (2 s): five missed, the worker leaves
HEALTH_INTERVAL_S = 1.0  # the router's own checks of each worker
ENGINE_ROLES: dict[str, WorkerRole] = {"prefill": "prefill", "decode": "decode"}


@dataclass(frozen=True)
class Member:
    role: str
    url: str
    node_id: str
    replica: str
    last_seen: float


class StartingGate:
    """503 with an OpenAI error body until a render replica has registered (the proxy has
    nowhere to render a request before that)."""

    def __init__(self, app: ASGIApp, ingress: ProxyIngress) -> None:
        self.app = app
        self.ingress = ingress

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.ingress.render_urls():
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(503, "the deployment is starting: no render replica yet")).encode()
        headers = [(b"content-type", b"application/json"), (b"retry-after", b"1")]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class ProxyIngress:
    """The ingress deployment's class (`app.py` wraps it with `serve.ingress`)."""

    def __init__(self, min_prefill_tokens: int, mode: str, open_health_metrics: bool, **tiers: Any) -> None:
        # `tiers`: the tier deployments' handles, bound here only to make them part of the
        # application; their replicas register themselves.
        self.pool = WorkerPool([], [], allow_no_decode=True)
        self.engine = PDEngineClient(self.pool, PDPolicy(min_prefill_tokens, mode, 30.0))
        self.proxy_app = create_proxy_app([], self.engine, health_interval_s=HEALTH_INTERVAL_S)
        self.frontend = self.proxy_app.state.service.frontend
        self.members: dict[str, Member] = {}
        api_key = os.environ.get(API_KEY_ENV) or None
        open_paths = OPEN_WITH_FLAG if open_health_metrics else frozenset()
        self.policy = AccessPolicy((api_key,) if api_key else (), open_paths)

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return StartingGate(AccessGuard(self.proxy_app, self.policy), self)

    def render_urls(self) -> list[str]:
        return self.frontend.base_urls

    async def register(self, role: str, url: str, node_id: str, replica: str) -> None:
        if url not in self.members:
            logger.warning("%s replica %s registered: %s", role, replica, url)
        self.members[url] = Member(role, url, node_id, replica, time.monotonic())
        if role == "render":
            self.sync_render_urls()
        else:
            self.pool.add(url, ENGINE_ROLES[role])

    async def deregister(self, url: str) -> None:
        member = self.members.pop(url, None)
        if member is None:
            return
        logger.warning("%s replica %s left: %s", member.role, member.replica, url)
        if member.role == "render":
            self.sync_render_urls()
        else:
            self.pool.remove(url)
            # its KV events: the subscription ends and the index forgets its blocks, so
            # cache-aware routing never scores a worker that is gone
            await asyncio.to_thread(self.engine.kv_feed.unwatch, url)

    def sync_render_urls(self) -> None:
        """The render client's replicas are the registered ones; the last one stays until
        another registers (calls to it fail as 503 meanwhile, never on an empty list)."""
        urls = [m.url for m in self.members.values() if m.role == "render"]
        if urls:
            self.frontend.base_urls[:] = urls

    async def check_health(self) -> None:
        """Serve's health check of the ingress: drops the workers whose heartbeats stopped."""
        now = time.monotonic()
        for url, member in list(self.members.items()):
            if now - member.last_seen > STALE_S:
                await self.deregister(url)

    async def workers(self) -> list[dict]:
        """Every registered worker: role, URL, node, replica and the router's view of it."""
        health = {w["url"]: w for w in self.pool.snapshot()}
        return [
            {
                "role": m.role,
                "url": m.url,
                "node_id": m.node_id,
                "replica": m.replica,
                "healthy": health.get(m.url, {}).get("healthy", True),
                "served": health.get(m.url, {}).get("served", 0),
                "in_flight": health.get(m.url, {}).get("in_flight", 0),
            }
            for m in self.members.values()
        ]
