"""The OpenAI-compatible HTTP API (`/v1/chat/completions`, `/v1/completions`, `/v1/models`).

Routes only: parsing a bounded body, validating it, and handing it to `OpenAIService`,
which renders, runs the engine through an `EngineClient` and derenders.

tool_choice: "auto" (and no tool_choice) parses Hermes `<tool_call>` blocks into
tool_calls; "none" still shows the tools to the template but parses no calls; "required"
and a named function are accepted and parsed like "auto" (a named function also limits
the tools the template shows to that one) but generation is not constrained, since there
is no guided decoding: the model may still answer in plain text.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from splitserve.frontend.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.frontend.render import Renderer
from splitserve.server.engine_client import EngineClient
from splitserve.server.errors import install_error_handlers
from splitserve.server.openai_service import OpenAIService
from splitserve.server.request_body import DEFAULT_MAX_BODY_BYTES, parse_model, read_json_body

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_openai_app(
    renderer: Renderer,
    engine_client: EngineClient,
    model_name: str | None = None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    on_startup: Callable[[], None] | None = None,
    on_shutdown: Callable[[], None] | None = None,
) -> FastAPI:
    """`on_startup`/`on_shutdown` let the caller start and stop what it owns (the
    collocated CLI's engine) with the app."""
    service = OpenAIService(renderer, engine_client, model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if on_startup:
            on_startup()
        try:
            yield
        finally:
            await engine_client.close()
            if on_shutdown:
                on_shutdown()

    app = FastAPI(title="splitserve OpenAI API", lifespan=lifespan)
    app.state.service = service
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy = await engine_client.check_health()
        return JSONResponse({"status": "ok" if healthy else "unhealthy"}, status_code=200 if healthy else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": service.model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "splitserve",
                    "max_model_len": renderer.max_model_len,
                }
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        request = parse_model(ChatCompletionRequest, await read_json_body(raw, max_body_bytes))
        if request.stream:
            events = await service.chat_stream(request)
            return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        return JSONResponse(await service.chat(request))

    @app.post("/v1/completions")
    async def completions(raw: Request):
        request = parse_model(CompletionRequest, await read_json_body(raw, max_body_bytes))
        if request.stream:
            events = await service.completion_stream(request)
            return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        return JSONResponse(await service.completion(request))

    return app
