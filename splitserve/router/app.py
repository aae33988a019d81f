"""The P/D proxy: the OpenAI service in front of a render tier and prefill/decode pools.

The same `OpenAIService` as `serve`, wired to the render tier over HTTP
(`HTTPFrontendClient`: one render per request, batched derender calls on pooled
keep-alive connections) and to `PDEngineClient` (prefill worker → KV transfer → decode
worker, each picked by the `--routing` policy: router/routing.py). Adds `/workers` and the
proxy's `/metrics`.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from splitserve.protocol.frontend_client import FrontendClient
from splitserve.router.encoder_pool import EncoderPool, EncoderPoolEngineClient
from splitserve.router.load import load_loop
from splitserve.router.pd_engine_client import PDEngineClient
from splitserve.router.routing import PromptTextFrontend, RoutingPolicy
from splitserve.router.workers import check_all, health_loop
from splitserve.runtime.http_edge import DEFAULT_MAX_BODY_BYTES
from splitserve.runtime.http_frontend_client import HTTPFrontendClient
from splitserve.service.app import create_openai_app


def create_proxy_app(
    render_url: str | list[str],
    engine: PDEngineClient,
    *,
    health_interval_s: float = 2.0,
    load_interval_s: float = 0.25,  # how often each worker's load is polled
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    encoder_urls: list[str] | None = None,  # images: encoded once on these, by hash
    encoder_pool: EncoderPool | None = None,  # or a pool whose encoders join later (Ray)
    kv_store_url: str | None = None,  # a KV store tier: its events credit the blocks it holds
) -> FastAPI:
    checker: list[asyncio.Future] = []  # the health and load loops, while the app runs

    async def start() -> None:
        # the first look at the workers before the proxy serves: its /health and
        # /v1/models tell the truth from the first request on
        await check_all(engine.pool, engine.check_worker)
        loop = health_loop(engine.pool, engine.check_worker, health_interval_s)
        checker.append(asyncio.ensure_future(loop))
        checker.append(asyncio.ensure_future(load_loop(engine.pool, engine.poll_load, load_interval_s)))
        if kv_store_url is not None:
            checker.append(asyncio.ensure_future(watch_store(engine, kv_store_url, health_interval_s)))

    async def stop() -> None:
        for task in checker:
            task.cancel()
        await asyncio.gather(*checker, return_exceptions=True)

    service_engine = engine
    if encoder_pool is None and encoder_urls:
        encoder_pool = EncoderPool(encoder_urls, engine.metrics.registry)
    if encoder_pool is not None:
        service_engine = EncoderPoolEngineClient(engine, encoder_pool)
    render_tier = HTTPFrontendClient(render_url)
    frontend: FrontendClient = render_tier
    if engine.router.policy is RoutingPolicy.TEXT_PREFIX:  # it routes on the client's text
        frontend = PromptTextFrontend(frontend)
    app = create_openai_app(
        frontend,
        service_engine,
        title="splitserve P/D proxy",
        max_body_bytes=max_body_bytes,
        on_startup=start,
        on_shutdown=stop,
        timeline_sink=engine.metrics,
    )
    app.state.engine = engine

    @app.get("/workers")
    async def workers() -> JSONResponse:
        return JSONResponse(
            {
                "workers": engine.pool.snapshot(),
                "render": render_tier.base_urls,
                "policy": engine.policy.__dict__,
                "routing": str(engine.router.policy),
                "kv_index_blocks": engine.kv_index.num_blocks(),
                "kv_store_blocks": engine.kv_index.store_blocks(),
                "load": engine.load_snapshot(),
                "pd_costs": engine.costs.snapshot(),
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def watch_store(engine: PDEngineClient, url: str, interval_s: float) -> None:
    """Until the KV store answers where its events are (it may start after the proxy)."""
    while not await engine.watch.watch_store(url):
        await asyncio.sleep(interval_s)
