"""The Ray deployment's ingress: the P/D proxy (`router/`), in process, behind Serve's HTTP
proxy, with its worker pools filled by the tier replicas as Serve brings them up.

Tier replicas call `register` on every Serve health check (a heartbeat) and `deregister`
when Serve tears them down; a worker whose heartbeats stop (its replica died) leaves
after `STALE_S`, and a prefill/decode worker that leaves also leaves the KV-event index.
Encoder replicas join the proxy's encoder pool; with an encoder tier the ingress keeps
the deployment's encoder cache (`EncoderCacheHome`). The KV store replica registers its
block address, which the engine replicas ask for before starting and get again with each
heartbeat, and the router follows its KV events (a replaced store: the old one's blocks
are forgotten, the new one's followed). The router's own health checks,
routing, retries and stream migration run unchanged: a dead worker is out of rotation at
its first failed request or check, long before it is dropped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from splitserve.deploy.plan import STORE_ROLE
from splitserve.protocol.errors import error_body
from splitserve.ray_serve.config import PlannerInputs
from splitserve.ray_serve.planner_loop import PlannerLoop
from splitserve.router.app import create_proxy_app
from splitserve.router.encoder_pool import EncoderPool
from splitserve.router.pd_engine_client import PDEngineClient
from splitserve.router.pd_policy import PDPolicy
from splitserve.router.workers import WorkerPool, WorkerRole
from splitserve.runtime.access import (
    API_KEY_ENV,
    OPEN_WITH_FLAG,
    AccessGuard,
    AccessPolicy,
    api_keys,
    internal_token,
)
from splitserve.runtime.process_lifetime import owned_directory, remove_dead_owners

logger = logging.getLogger(__name__)

EC_DIRECTORY_PREFIX = "splitserve-ec-ray-"
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
    encoder_cache: str | None  # how its server reaches the encoder cache: shm, tcp or not at all
    kv_store: str | None  # the KV store's block address: a store's own, an engine's store


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


class EncoderCacheHome:
    """The deployment's one encoder cache, kept by the ingress: a directory on its node's
    tmpfs, served to the other nodes by an `ECServer` on the node's address (answering only
    the deployment's internal token). Replicas on this node read and write the directory
    (shm); the others reach the server (tcp). It lives as long as the ingress, like the
    router's memory of which images were encoded."""

    def __init__(self, node_id: str, host: str) -> None:
        from splitserve.encoder_cache.connector import SharedMemoryECConnector, default_shm_directory
        from splitserve.encoder_cache.tcp import ECServer

        root = str(default_shm_directory("ray").parent)
        # Named after this process: the cache of an ingress killed outright (its close never
        # ran) is removed by the next one on the node.
        remove_dead_owners(EC_DIRECTORY_PREFIX, root)
        self.directory = owned_directory(EC_DIRECTORY_PREFIX, root)
        self.server = ECServer(SharedMemoryECConnector(self.directory), host=host, token=internal_token())
        self.address = {"node_id": node_id, "shm_dir": self.directory, "host": host, "port": self.server.port}

    def close(self) -> None:
        self.server.close()
        shutil.rmtree(self.directory, ignore_errors=True)


class ProxyIngress:
    """The ingress deployment's class (`app.py` wraps it with `serve.ingress`)."""

    def __init__(
        self,
        min_prefill_tokens: int,
        mode: str,
        open_health_metrics: bool,
        encoder_cache: bool = False,
        pd_decision: str = "cost",
        planner: PlannerInputs | None = None,
        **tiers: Any,
    ) -> None:
        # `tiers`: the tier deployments' handles, bound here only to make them part of the
        # application; their replicas register themselves.
        self.pool = WorkerPool([], [], allow_no_decode=True)
        self.engine = PDEngineClient(
            self.pool, PDPolicy(min_prefill_tokens, mode, 30.0, decision=pd_decision)
        )
        self.encoders: EncoderPool | None = None
        self.ec_home: EncoderCacheHome | None = None
        if encoder_cache:  # images: encoded once by the encoder tier, loaded by hash
            import ray

            self.encoders = EncoderPool([], self.engine.metrics.registry, allow_empty=True)
            node_id = ray.get_runtime_context().get_node_id()
            self.ec_home = EncoderCacheHome(node_id, ray.util.get_node_ip_address())
        self.proxy_app = create_proxy_app(
            [], self.engine, health_interval_s=HEALTH_INTERVAL_S, encoder_pool=self.encoders
        )
        self.frontend = self.proxy_app.state.service.frontend
        self.members: dict[str, Member] = {}
        self.store: Member | None = None  # the KV store replica whose events the router follows
        self.store_watched = False  # its events followed (it answered where they are)
        open_paths = OPEN_WITH_FLAG if open_health_metrics else frozenset()
        self.policy = AccessPolicy(api_keys(os.environ.get(API_KEY_ENV)), open_paths)
        self.planner = None if planner is None else PlannerLoop(planner, self.engine.traffic)

    def encoder_cache(self) -> dict[str, Any] | None:
        """Where the encoder cache is (node, directory, server address), or None when the
        deployment has no encoder tier; a replica starts its server against it."""
        return None if self.ec_home is None else dict(self.ec_home.address)

    def kv_store(self) -> str | None:
        """The KV store's block address (HOST:PORT) once its replica has registered; an
        engine replica starts its server against it."""
        return None if self.store is None else self.store.kv_store

    def __del__(self) -> None:
        if getattr(self, "ec_home", None) is not None:
            self.ec_home.close()

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return StartingGate(AccessGuard(self.proxy_app, self.policy), self)

    def render_urls(self) -> list[str]:
        return self.frontend.base_urls

    async def register(
        self,
        role: str,
        url: str,
        node_id: str,
        replica: str,
        encoder_cache: str | None = None,
        kv_store: str | None = None,
    ) -> dict[str, Any]:
        """A replica's heartbeat; answers where the encoder cache is (a replica whose server
        was started against another one restarts: the ingress, and its cache, were replaced),
        where the KV store is (an engine follows a replaced store) and, with `--ray-planner`,
        its tier's replica target."""
        if self.planner is not None:
            self.planner.ensure_running()
        if url not in self.members:
            logger.warning("%s replica %s registered: %s", role, replica, url)
        self.members[url] = Member(role, url, node_id, replica, time.monotonic(), encoder_cache, kv_store)
        if role == "render":
            self.sync_render_urls()
        elif role == STORE_ROLE:
            await self.follow_store(self.members[url])
        elif role == "encoder":
            if self.encoders is not None:
                self.encoders.add(url)
        else:
            self.pool.add(url, ENGINE_ROLES[role])
        planned = None if self.planner is None else self.planner.targets().get(role)
        return {
            "encoder_cache": self.encoder_cache(),
            "kv_store": self.kv_store(),
            "planned_replicas": planned,
        }

    async def follow_store(self, store: Member) -> None:
        """`store` is the deployment's KV store (the latest to register: Serve runs one
        replica, and a replacement registers before the dead one's heartbeats are missed):
        the router forgets the previous one's blocks and follows this one's events."""
        if self.store is not None and self.store.url != store.url:
            logger.warning("the KV store moved: %s -> %s", self.store.url, store.url)
            await self.forget_store()
        self.store = store
        if not self.store_watched:  # until it answers where its events are
            self.store_watched = await self.engine.watch.watch_store(store.url)

    async def forget_store(self) -> None:
        if self.store is not None:
            await asyncio.to_thread(self.engine.watch.forget_store, self.store.url)
        self.store, self.store_watched = None, False

    async def deregister(self, url: str) -> None:
        member = self.members.get(url)
        if member is None:
            return
        if member.role in ENGINE_ROLES:
            self.pool.remove(url)
            # its KV events: the subscription ends and the index forgets its blocks (before
            # it leaves the listing), so cache-aware routing never scores a worker that is
            # gone; a replica registered again under the URL is checked and followed afresh
            await asyncio.to_thread(self.engine.forget_worker, url)
        if member.role == STORE_ROLE and self.store is not None and self.store.url == url:
            await self.forget_store()
        if self.members.pop(url, None) is None:
            return  # another call took it out meanwhile
        logger.warning("%s replica %s left: %s", member.role, member.replica, url)
        if member.role == "render":
            self.sync_render_urls()
        elif member.role == "encoder" and self.encoders is not None:
            self.encoders.remove(url)

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

    async def planner_decisions(self) -> list[dict]:
        """`--ray-planner`'s decisions so far, oldest first (empty without it)."""
        return [] if self.planner is None else self.planner.decisions()

    async def workers(self) -> list[dict]:
        """Every registered worker: role, URL, node, replica, how it reaches the encoder
        cache, the KV store's address, and the router's view of it."""
        health = {w["url"]: w for w in self.pool.snapshot()}
        return [
            {
                "role": m.role,
                "url": m.url,
                "node_id": m.node_id,
                "replica": m.replica,
                "encoder_cache": m.encoder_cache,
                "kv_store": m.kv_store,
                "healthy": health.get(m.url, {}).get("healthy", True),
                "served": health.get(m.url, {}).get("served", 0),
                "in_flight": health.get(m.url, {}).get("in_flight", 0),
            }
            for m in self.members.values()
        ]
