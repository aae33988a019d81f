"""The HTTP `EngineClient`: `/inference/v1/generate` of a `splitserve engine`, or of
`vllm serve --enable-scale-out`, read as SSE with httpx.

vLLM sends usage in a separate chunk with no choices after the finishing one; it is
folded into the finishing chunk so that, with either server, the last chunk yielded is
the one with a finish_reason and it carries usage.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator

import httpx

from splitserve.protocol.engine_client import EngineClient
from splitserve.protocol.errors import APIError
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.runtime.http_pool import pooled_client


class HTTPEngineClient(EngineClient):
    def __init__(
        self,
        base_url: str,
        *,
        timeout: float | None = None,
        client: httpx.AsyncClient | None = None,
        name: str = "engine",
    ):
        self.base_url = base_url.rstrip("/")
        self.name = name  # what errors call this engine ("decode worker"): the part that failed
        self._owns_client = client is None
        # No read timeout by default: a long generation may be silent while queued.
        self._client = client or pooled_client(read_timeout_s=timeout)

    def generate(self, request: GenerateRequest) -> AsyncIterator[dict]:
        return self._generate(request)

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[dict]:
        # streamed, with usage on the final chunk; `to_wire` leaves the routing hints out
        body = dataclasses.replace(request, stream=True, include_usage=True).to_wire()
        try:
            async with self._client.stream(
                "POST", f"{self.base_url}/inference/v1/generate", json=body
            ) as response:
                if response.status_code != 200:
                    error = APIError.from_body(response.status_code, await _json_or_text(response), self.name)
                    retry_after = response.headers.get("retry-after", "")
                    error.retry_after_s = int(retry_after) if retry_after.isdigit() else None
                    raise error  # a 429's Retry-After reaches the client through the proxy
                held: dict | None = None  # the finishing chunk, until usage has arrived
                async for chunk in _sse_events(response):
                    if held is not None:
                        if not chunk.get("choices"):
                            for key in ("usage", "metrics"):
                                if chunk.get(key) is not None:
                                    held[key] = chunk[key]
                            continue
                        yield held
                        held = None
                    if "error" in chunk:  # the engine failed after the stream started
                        raise APIError.from_body(502, chunk, self.name)
                    if any(c.get("finish_reason") is not None for c in chunk.get("choices") or []):
                        held = chunk
                    elif chunk.get("choices"):
                        yield chunk
                if held is not None:
                    yield held
        except httpx.TransportError as exc:
            raise APIError(503, f"{self.name} at {self.base_url} is unreachable: {exc}") from exc

    async def abort(self, request_ids: list[str]) -> None:
        try:
            await self._client.post(
                f"{self.base_url}/inference/v1/abort_requests", json={"request_ids": request_ids}
            )
        except httpx.TransportError as exc:
            raise APIError(503, f"{self.name} at {self.base_url} is unreachable: {exc}") from exc

    async def check_health(self) -> bool:
        try:
            response = await self._client.get(f"{self.base_url}/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()


async def _sse_events(response: httpx.Response) -> AsyncIterator[dict]:
    """The JSON payloads of an SSE stream's `data:` events, up to `[DONE]`."""
    data: list[str] = []
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif line == "" and data:
            payload = "\n".join(data)
            data = []
            if payload == "[DONE]":
                return
            try:
                yield json.loads(payload)
            except json.JSONDecodeError as exc:
                raise APIError(502, f"engine sent a malformed event: {payload[:200]!r}") from exc


async def _json_or_text(response: httpx.Response) -> object:
    body = await response.aread()
    try:
        return json.loads(body)
    except ValueError:
        return body.decode(errors="replace")
