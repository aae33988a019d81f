"""The HTTP `FrontendClient`: a `splitserve render` tier, over one pooled keep-alive
connection pool. The chat request crosses once (render, with `?derender_state=true`);
derender calls carry only new tokens and each choice's signed state, and the derender
pieces of concurrent requests share calls (`CallBatcher`)."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import httpx

from splitserve.protocol.derender_api import MAX_PIECES
from splitserve.protocol.errors import APIError
from splitserve.protocol.frontend_client import (
    DerenderedPiece,
    DerenderPiece,
    FrontendClient,
    RenderedPrompt,
)
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from splitserve.protocol.openai_chunks import delta_from_wire
from splitserve.runtime.call_batcher import CallBatcher
from splitserve.runtime.http_pool import pooled_client

RETRY_S = 30.0  # how long a call keeps trying the render replicas (one being restarted)


class HTTPFrontendClient(FrontendClient):
    """`base_url`: one render replica, or several sharing a `--state-key` (any replica
    continues any stream). Render and derender calls are pure functions of their body, so
    a call that finds a replica unreachable or draining (503) is retried on the next one,
    with backoff, for up to `retry_s`."""

    def __init__(
        self,
        base_url: str | list[str],
        *,
        max_connections: int = 8,
        client: httpx.AsyncClient | None = None,
        retry_s: float = RETRY_S,
    ) -> None:
        urls = [base_url] if isinstance(base_url, str) else base_url
        self.base_urls = [url.rstrip("/") for url in urls]
        self.retry_s = retry_s
        self._calls = 0
        self._owns_client = client is None
        # Keep-alive: a derender call per engine chunk must not pay a TCP handshake.
        self._http = client or pooled_client(
            read_timeout_s=60.0, max_connections=max_connections, keepalive=max_connections
        )
        self._derender_calls: CallBatcher[DerenderPiece, DerenderedPiece] = CallBatcher(
            self._derender_call, max_items=MAX_PIECES, link=_continued
        )

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        self._calls += 1
        deadline = time.monotonic() + self.retry_s
        for attempt in itertools.count():
            url = self.base_urls[(self._calls + attempt) % len(self.base_urls)]
            try:
                response = await self._http.request(method, f"{url}{path}", json=body)
            except httpx.TransportError as exc:
                failure = APIError(503, f"render tier at {url} is unreachable: {exc}")
            else:
                try:
                    payload = response.json()
                except ValueError:
                    payload = response.text
                if response.status_code == 200:
                    return payload
                failure = APIError.from_body(response.status_code, payload, f"render tier at {url}")
                if response.status_code != 503:
                    raise failure
            if time.monotonic() + _backoff_s(attempt) > deadline:
                raise failure
            await asyncio.sleep(_backoff_s(attempt))
        raise AssertionError("unreachable")

    async def models(self) -> dict[str, Any]:
        return await self._call("GET", "/v1/models")

    async def render_chat(self, request: ChatCompletionRequest) -> RenderedPrompt:
        body = request.model_dump(mode="json", exclude_unset=True)
        generate = await self._call("POST", "/v1/chat/completions/render?derender_state=true", body)
        return _rendered(generate)

    async def render_completion(self, request: CompletionRequest) -> list[RenderedPrompt]:
        body = request.model_dump(mode="json", exclude_unset=True)
        generates = await self._call("POST", "/v1/completions/render?derender_state=true", body)
        return [_rendered(generate) for generate in generates]

    async def derender(self, pieces: list[DerenderPiece]) -> list[DerenderedPiece]:
        return await self._derender_calls.call(pieces)

    async def _derender_call(self, pieces: list[DerenderPiece]) -> list[DerenderedPiece]:
        body = {
            "pieces": [
                {
                    "state": piece.state,
                    "index": piece.index,
                    "token_ids": piece.token_ids,
                    "logprobs": piece.logprobs,
                    "finish_reason": piece.finish_reason,
                    "final": piece.final,
                }
                for piece in pieces
            ]
        }
        answer = await self._call("POST", "/v1/derender/pieces", body)
        return [
            DerenderedPiece(
                item["state"], delta_from_wire(item["delta"]), item["finish_reason"], item["stopped"]
            )
            for item in answer["pieces"]
        ]

    async def close(self) -> None:
        await self._derender_calls.close()
        if self._owns_client:
            await self._http.aclose()


def _continued(piece: DerenderPiece, before: DerenderedPiece) -> DerenderPiece:
    """A piece that continues the one before it, sent in the next call: it starts from the
    state that piece returned (a null state continues only within one call)."""
    return piece._replace(state=before.state) if piece.state is None else piece


def _backoff_s(attempt: int) -> float:
    return min(2.0, 0.1 * 2**attempt)


def _rendered(generate: dict) -> RenderedPrompt:
    """The render tier's answer, parsed once: the generate request (pixels unread: the
    engines check them) and the way back's signed start state."""
    state = generate.pop("derender_state")
    return RenderedPrompt(
        GenerateRequest.from_wire(generate, max_pixel_bytes=None, routing_hints=True), state
    )
