"""The P/D proxy: the OpenAI chat API in front of a render tier and prefill/decode pools.

Each chat request is rendered once by the render tier (`/v1/chat/completions/render`),
run through `PDEngineClient` (prefill worker → KV transfer → decode worker, chosen least
loaded) and turned back into OpenAI chunks by the render tier's derender, which carries
the parser's compact signed `stream_state` from chunk to chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from splitserve.router.workers import health_loop
from splitserve.server.engine_protocol import merge_chunks
from splitserve.server.errors import APIError, error_body, install_error_handlers
from splitserve.server.pd_client import PDEngineClient
from splitserve.server.request_body import DEFAULT_MAX_BODY_BYTES, read_json_body

logger = logging.getLogger(__name__)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


class RenderClient:
    """The render tier over HTTP; its 4xx answers become the proxy's."""

    def __init__(self, base_url: str, http: httpx.AsyncClient):
        self.base_url = base_url.rstrip("/")
        self._http = http

    async def post(self, path: str, body: dict) -> Any:
        try:
            response = await self._http.post(f"{self.base_url}{path}", json=body)
        except httpx.HTTPError as exc:
            raise APIError(503, f"render tier at {self.base_url} is unreachable: {exc}") from exc
        if response.status_code != 200:
            try:
                error = response.json()["error"]
                raise APIError(response.status_code, str(error["message"]), error.get("param"))
            except (ValueError, KeyError, TypeError):
                raise APIError(response.status_code, f"render tier answered {response.status_code}") from None
        return response.json()

    async def get(self, path: str) -> Any:
        try:
            response = await self._http.get(f"{self.base_url}{path}", timeout=5.0)
        except httpx.HTTPError as exc:
            raise APIError(503, f"render tier at {self.base_url} is unreachable: {exc}") from exc
        if response.status_code != 200:
            raise APIError(503, f"render tier answered {response.status_code}")
        return response.json()


def create_proxy_app(
    render_url: str,
    engine: PDEngineClient,
    *,
    health_interval_s: float = 2.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    http = httpx.AsyncClient(
        timeout=httpx.Timeout(60.0, connect=10.0), limits=httpx.Limits(max_connections=None)
    )
    render = RenderClient(render_url, http)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        checker = asyncio.ensure_future(health_loop(engine.pool, engine.check_worker, health_interval_s))
        try:
            yield
        finally:
            checker.cancel()
            await asyncio.gather(checker, return_exceptions=True)
            await engine.close()
            await http.aclose()

    app = FastAPI(title="splitserve P/D proxy", lifespan=lifespan)
    app.state.engine = engine
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy = await engine.check_health()
        return JSONResponse(
            {"status": "ok" if healthy else "no decode worker"}, status_code=200 if healthy else 503
        )

    @app.get("/workers")
    async def workers() -> JSONResponse:
        return JSONResponse({"workers": engine.pool.snapshot(), "policy": engine.policy.__dict__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(await render.get("/v1/models"))

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        body = await read_json_body(raw, max_body_bytes)
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        if body.get("n") not in (None, 1):
            raise APIError(400, "the P/D proxy serves n=1 only", param="n")
        generate = await render.post("/v1/chat/completions/render", body)
        prompt_ids = generate["token_ids"]
        if body.get("stream") is True:
            chunks = engine.generate({**generate, "stream": True})
            try:
                first = await anext(chunks)  # errors before any output still get a status code
            except StopAsyncIteration:
                raise APIError(502, "the decode worker ended the stream without output") from None
            except BaseException:
                await chunks.aclose()
                raise
            return StreamingResponse(
                _stream(render, body, prompt_ids, first, chunks),
                media_type="text/event-stream",
                headers=_SSE_HEADERS,
            )
        collected = [chunk async for chunk in engine.generate({**generate, "stream": True})]
        response = merge_chunks(collected)
        derender_body = {"generate_response": response, "chat_request": body, "prompt_token_ids": prompt_ids}
        return JSONResponse(await render.post("/v1/chat/completions/derender", derender_body))

    @app.post("/v1/completions")
    async def completions() -> Response:
        # Derendering plain completions needs the tokenizer, which only the render tier's
        # chat derender exposes over HTTP: say so rather than answer a bare 404.
        raise APIError(404, "the P/D proxy serves /v1/chat/completions only", code="not_supported")

    return app


async def _stream(
    render: RenderClient, chat_request: dict, prompt_ids: list[int], first: dict, chunks: AsyncIterator[dict]
) -> AsyncIterator[str]:
    state: str | None = None
    try:
        chunk: dict | None = first
        while chunk is not None:
            derendered = await render.post(
                "/v1/chat/completions/derender",
                {
                    "stream": True,
                    "generate_chunk": chunk,
                    "stream_state": state,
                    "chat_request": chat_request,
                    "prompt_token_ids": prompt_ids if state is None else None,
                },
            )
            state = derendered["stream_state"]
            out = derendered["chunk"]
            if out.get("choices") or out.get("usage"):
                yield _sse(out)
            if any(c.get("finish_reason") for c in out.get("choices") or []):
                break  # finished (a stop string may end it before the engine does)
            chunk = await anext(chunks, None)
        yield "data: [DONE]\n\n"
    except APIError as exc:
        logger.warning("stream failed after it started: %s", exc.message)
        yield _sse(error_body(exc.status, exc.message, exc.param))
        yield "data: [DONE]\n\n"
    finally:
        await chunks.aclose()
