"""The OpenAI-compatible HTTP API (`/v1/chat/completions`, `/v1/completions`, `/v1/models`),
the same for `serve` and the P/D proxy.

Routes only: a bounded body is validated once into an immutable request value and handed
to `OpenAIService`, which renders, runs the engine and derenders.

tool_choice: "auto" (and no tool_choice) parses Hermes `<tool_call>` blocks into
tool_calls; "none" still shows the tools to the template but parses no calls; "required"
and a named function are accepted and parsed like "auto" (a named function also limits
the tools the template shows to that one) but generation is not constrained, since there
is no guided decoding: the model may still answer in plain text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from splitserve.protocol.engine_client import EngineClient
from splitserve.protocol.errors import APIError
from splitserve.protocol.frontend_client import FrontendClient
from splitserve.runtime.http_edge import (
    DEFAULT_MAX_BODY_BYTES,
    SSE_HEADERS,
    install_error_handlers,
    parse_model,
    read_json_body,
)
from splitserve.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from splitserve.protocol.timeline import TIMELINE_HEADER, TimelineSink, wanted
from splitserve.service.openai_service import OpenAIService

Hook = Callable[[], Awaitable[None]]


def create_openai_app(
    frontend: FrontendClient,
    engine: EngineClient,
    *,
    title: str = "splitserve OpenAI API",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    on_startup: Hook | None = None,
    on_shutdown: Hook | None = None,
    timeline_sink: TimelineSink | None = None,
) -> FastAPI:
    """`on_startup`/`on_shutdown` start and stop what the caller owns with the app (the
    collocated engine, the proxy's health checks); `timeline_sink` gets every request's
    phases. A request with `x-splitserve-timeline: 1` gets them in its response
    (`splitserve_timeline`, protocol/timeline.py)."""
    service = OpenAIService(frontend, engine, timeline_sink)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if on_startup:
            await on_startup()
        try:
            yield
        finally:
            if on_shutdown:
                await on_shutdown()
            await service.close()

    app = FastAPI(title=title, lifespan=lifespan)
    app.state.service = service
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy = await engine.check_health()
        return JSONResponse({"status": "ok" if healthy else "unhealthy"}, status_code=200 if healthy else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        # A client that waits for the model list and then sends must find an engine: the
        # list is there only while /health would say ok (a proxy before any decode worker
        # has registered, on Ray, answers 503 here too)
        if not await engine.check_health():
            raise APIError(503, "no engine worker is ready yet", code="no_worker", retry_after_s=1)
        return await frontend.models()

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        request = parse_model(ChatCompletionRequest, await read_json_body(raw, max_body_bytes))
        timeline = wanted(raw.headers.get(TIMELINE_HEADER))
        if request.stream:
            events = await service.chat_stream(request, timeline=timeline)
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(await service.chat(request, timeline=timeline))

    @app.post("/v1/completions")
    async def completions(raw: Request):
        request = parse_model(CompletionRequest, await read_json_body(raw, max_body_bytes))
        timeline = wanted(raw.headers.get(TIMELINE_HEADER))
        if request.stream:
            events = await service.completion_stream(request, timeline=timeline)
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(await service.completion(request, timeline=timeline))

    return app
