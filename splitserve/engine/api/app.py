"""The engine's HTTP API (any role): `/inference/v1/generate`, `/inference/v1/abort_requests`,
`/health`, `/metrics`. Shapes: DESIGN.md "Wire APIs" and engine_protocol.py.

The engine loop runs in its own thread (AsyncEngine); handlers only await its outputs.
A client that disconnects, streaming or not, aborts its request and frees its blocks.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from splitserve.engine.api.disconnect import CLIENT_GONE_STATUS, first_of
from splitserve.engine.api.local_client import LocalEngineClient
from splitserve.engine.api.metrics import EngineMetrics
from splitserve.engine.api.mm_metrics import MultiModalCollector
from splitserve.engine.async_engine import AsyncEngine
from splitserve.protocol.engine_api import merge_chunks
from splitserve.protocol.errors import APIError
from splitserve.protocol.generate_request import DEFAULT_MAX_PIXEL_BYTES
from splitserve.runtime.http_edge import install_error_handlers, read_json_body

MAX_BODY_BYTES = 64 * 1024 * 1024


class _EventStream(StreamingResponse):
    """SSE that stops as soon as the client goes away (not only at the next send) and
    always closes its iterator, which aborts the request in the engine."""

    body_iterator: AsyncIterator[str]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            with contextlib.suppress(OSError):  # the client left while we were sending
                await self.stream_response(send)

        try:
            await first_of(stream(), receive)
        finally:
            await self.body_iterator.aclose()


def _sse(chunk: dict) -> str:
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"


def create_engine_app(
    engine: AsyncEngine,
    *,
    max_model_len: int | None = None,
    metrics: EngineMetrics | None = None,
    manage_engine: bool = False,
    max_pixel_bytes: int = DEFAULT_MAX_PIXEL_BYTES,  # decoded image pixels per request
) -> FastAPI:
    """The engine API over a started `AsyncEngine`. With `manage_engine`, the app starts
    the engine on startup and shuts it down on shutdown (the CLI); otherwise the caller
    owns its life (tests, the collocated server)."""
    max_model_len = max_model_len or engine.model_info.max_model_len
    metrics = metrics or EngineMetrics(engine.stats)
    engine.add_step_listener(metrics.on_step)
    if engine.engine.multimodal is not None:  # a vision-language model: image counters
        metrics.registry.register(MultiModalCollector(engine.engine.multimodal.stats))
    if engine.engine.runner.ffn is not None:  # attention-FFN disaggregation: the traffic per step
        from splitserve.afd.metrics import AfdStepMetrics

        engine.add_step_listener(AfdStepMetrics(engine.engine.runner.ffn, metrics.registry).on_step)
    client = LocalEngineClient(engine, metrics, max_model_len=max_model_len, max_pixel_bytes=max_pixel_bytes)
    body_limit = MAX_BODY_BYTES + max_pixel_bytes * 4 // 3  # images: base64 pixels in `features`

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                engine.shutdown()

    app = FastAPI(title="splitserve engine", lifespan=lifespan)
    app.state.engine = engine
    app.state.engine_client = client
    app.state.metrics = metrics
    install_error_handlers(app)

    @app.post("/inference/v1/generate")
    async def generate(raw_request: Request) -> Response:
        request = client.parse(await read_json_body(raw_request, body_limit))
        admit = getattr(app.state, "admit_generate", None)  # P/D: the reservation quota
        if admit is not None:
            admit(request.kv_transfer_params)
        chunks = client.stream(request, force_usage=not request.stream)
        try:
            # Rejections by the engine (413, out-of-vocabulary, duplicate ID) come before
            # the first chunk, so they still get a status code rather than a broken stream.
            gone, first = await first_of(anext(chunks), raw_request.receive)
        except BaseException:
            await chunks.aclose()
            raise
        if gone:  # the client left while the request was queued
            await chunks.aclose()
            return Response(status_code=CLIENT_GONE_STATUS)

        if request.stream:

            async def events() -> AsyncIterator[str]:
                try:
                    yield _sse(first)
                    async for chunk in chunks:
                        yield _sse(chunk)
                    yield "data: [DONE]\n\n"
                finally:
                    await chunks.aclose()

            return _EventStream(
                events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )

        async def collect() -> list[dict]:
            collected = [first]
            async for chunk in chunks:
                collected.append(chunk)
            return collected

        try:
            disconnected, collected = await first_of(collect(), raw_request.receive)
        finally:
            await chunks.aclose()
        if disconnected:
            return Response(status_code=CLIENT_GONE_STATUS)  # nobody is listening; the request was aborted
        return JSONResponse(merge_chunks(collected))

    @app.post("/inference/v1/abort_requests")
    async def abort_requests(raw_request: Request) -> JSONResponse:
        body = await read_json_body(raw_request, MAX_BODY_BYTES)
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        request_ids = body.get("request_ids")
        if (
            not isinstance(request_ids, list)
            or not request_ids
            or not all(isinstance(rid, str) for rid in request_ids)
        ):
            raise APIError(400, "request_ids must be a non-empty list of strings", param="request_ids")
        aborted = client.abort_known(request_ids)
        if not aborted:
            raise APIError(
                404, f"no request in flight with any of the IDs {request_ids}", param="request_ids"
            )
        return JSONResponse({"aborted": aborted, "unknown": [r for r in request_ids if r not in aborted]})

    @app.get("/health")
    async def health() -> JSONResponse:
        if not await client.check_health():
            raise APIError(503, "engine is not running")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/inference/v1/stats")
    async def stats() -> JSONResponse:
        found = engine.stats()
        return JSONResponse({**found._asdict(), "last_step_shape": found.last_step_shape._asdict()})

    return app
