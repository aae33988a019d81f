"""An async streaming client for OpenAI-compatible servers that timestamps every chunk.

One `send` is one streamed request to `/v1/chat/completions` or `/v1/completions`. Every
network read is stamped with `time.perf_counter` once, and every output chunk in it gets
that stamp: the time the bytes reached the client. Whatever goes wrong (refused
connection, HTTP error, garbage in the stream, a stall past the timeout) becomes the
record's `error`; `send` never raises for a server's misbehaviour.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import httpx

from splitserve.bench.metrics import RequestRecord

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# asks a splitserve server for the request's phases (its last chunk's `splitserve_timeline`);
# other servers ignore the header
TIMELINE_HEADERS = {"x-splitserve-timeline": "1"}
TIMELINE_FIELD = "splitserve_timeline"
_raw_decode_json = json.JSONDecoder().raw_decode


def _decode_json(text: str) -> object:
    """json.loads for one SSE payload, without its per-call checks (this is the hot loop)."""
    text = text.strip()
    value, end = _raw_decode_json(text)
    if end != len(text):
        raise ValueError("extra data after the JSON value")
    return value


_ERROR_BODY_LIMIT = 300


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    model: str
    endpoint: str = "chat"  # "chat" or "completions"
    timeout: float = 300.0  # seconds for a whole request
    ignore_eos: bool = True
    temperature: float | None = 0.0
    extra_body: dict = field(default_factory=dict)
    api_key: str | None = None  # sent as `Authorization: Bearer`, OpenAI's convention


def bearer(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class Reply(NamedTuple):
    record: RequestRecord
    text: str  # the answer's text, for the next turn of a conversation


class StreamError(Exception):
    """The server sent something that is not a valid OpenAI stream."""


class SSEParser:
    """Splits a byte stream into server-sent events' `data` payloads (as text)."""

    def __init__(self) -> None:
        # Incremental: a UTF-8 character split across two network reads is kept for the next.
        self._decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        self._buffer = ""

    def feed(self, data: bytes) -> list[str]:
        buffer = self._buffer + self._decode(data)
        if "\r" in buffer:
            buffer = buffer.replace("\r\n", "\n")
        *events, self._buffer = buffer.split("\n\n")
        payloads = []
        for event in events:
            if event.startswith("data: ") and "\n" not in event:  # the usual one-line event
                payloads.append(event[6:])
                continue
            lines = [line[5:].lstrip(" ") for line in event.split("\n") if line.startswith("data:")]
            if lines:
                payloads.append("\n".join(lines))
        return payloads


def chunk_output(chunk: dict) -> tuple[str, bool]:
    """The text a chunk adds, and whether it carries any output at all (text, reasoning or
    tool calls). Raises StreamError for a chunk of the wrong shape."""
    if "error" in chunk:
        error = chunk["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise StreamError(f"error event: {message}")
    # Some servers send the usage chunk without an (empty) choices list.
    choices = chunk.get("choices", [] if "usage" in chunk else None)
    if not isinstance(choices, list):
        raise StreamError("a chunk without a 'choices' list")
    text, carries = "", False
    for choice in choices:
        if not isinstance(choice, dict):
            raise StreamError("a choice that is not an object")
        if "delta" in choice:
            delta = choice["delta"] or {}
            content = delta.get("content") or ""
            reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
            text += content
            carries = carries or bool(content or reasoning or delta.get("tool_calls"))
        else:
            piece = choice.get("text")
            if piece is None and choice.get("finish_reason") is None:
                raise StreamError("a choice with neither 'delta' nor 'text'")
            text += piece or ""
            carries = carries or bool(piece)
    return text, carries


class StreamingClient:
    """Holds one httpx connection pool; use as `async with StreamingClient(...) as client`."""

    def __init__(
        self,
        config: ClientConfig,
        count_tokens: Callable[[str], int] | None = None,
        max_connections: int = 1000,
    ) -> None:
        if config.endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {config.endpoint!r}: use one of {sorted(ENDPOINTS)}")
        self.config = config
        self._url = config.base_url.rstrip("/") + ENDPOINTS[config.endpoint]
        self._count_tokens = count_tokens
        self._http = httpx.AsyncClient(
            headers={**bearer(config.api_key), **TIMELINE_HEADERS},
            timeout=httpx.Timeout(config.timeout, connect=min(config.timeout, 30.0)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def __aenter__(self) -> StreamingClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._http.aclose()

    def body(self, messages: list[dict], max_tokens: int) -> dict:
        config = self.config
        body: dict = {"model": config.model, "max_tokens": max_tokens, "stream": True}
        if config.endpoint == "chat":
            body["messages"] = messages
        else:
            body["prompt"] = "\n".join(m["content"] for m in messages)
        body["stream_options"] = {"include_usage": True}
        if config.ignore_eos:
            body["ignore_eos"] = True
        if config.temperature is not None:
            body["temperature"] = config.temperature
        body.update(config.extra_body)
        return body

    async def send(
        self,
        messages: list[dict],
        max_tokens: int,
        input_tokens: int,
        clock_start: float,
        request_id: int,
        warmup: bool = False,
        session: int = 0,
        turn: int = 0,
    ) -> Reply:
        """Send one request; `input_tokens` is the client's count, replaced by the server's
        `usage.prompt_tokens` when it reports one."""
        body = self.body(messages, max_tokens)
        times: list[float] = []
        pieces: list[str] = []
        usage: dict = {}
        timeline: dict = {}
        start = time.perf_counter()
        error: str | None = None
        try:
            await asyncio.wait_for(
                self._stream(body, start, times, pieces, usage, timeline), self.config.timeout
            )
        except asyncio.TimeoutError:
            error = f"timeout: no complete answer within {self.config.timeout:g}s"
        except StreamError as exc:
            error = str(exc)
        except httpx.ConnectError as exc:
            error = f"connect: {exc or type(exc).__name__}"
        except httpx.TimeoutException as exc:
            error = f"timeout: {type(exc).__name__}"
        except httpx.HTTPError as exc:
            error = f"transport: {type(exc).__name__}: {exc}"
        text = "".join(pieces)
        output_tokens = usage.get("completion_tokens")
        if not isinstance(output_tokens, int):
            output_tokens = self._count_tokens(text) if self._count_tokens and text else len(times)
        prompt_tokens = usage.get("prompt_tokens")
        record = RequestRecord(
            request_id=request_id,
            start=start - clock_start,
            chunk_times=tuple(times),
            input_tokens=prompt_tokens if isinstance(prompt_tokens, int) else input_tokens,
            output_tokens=output_tokens,
            error=error,
            warmup=warmup,
            session=session,
            turn=turn,
            timeline=timeline or None,
        )
        return Reply(record, text)

    async def _stream(
        self,
        body: dict,
        start: float,
        times: list[float],
        pieces: list[str],
        usage: dict,
        timeline: dict,
    ) -> None:
        async with self._http.stream("POST", self._url, json=body) as response:
            if response.status_code != 200:
                raw = (await response.aread())[: _ERROR_BODY_LIMIT * 4]
                raise StreamError(f"HTTP {response.status_code}: {_error_message(raw)}")
            content_type = response.headers.get("content-type", "")
            if "text/event-stream" not in content_type:
                kind = content_type or "missing"
                raise StreamError(f"bad stream: content-type {kind!r}, not an event stream")
            parser = SSEParser()
            done = False
            async for data in response.aiter_bytes():
                now = time.perf_counter() - start
                for payload in parser.feed(data):
                    if done:
                        raise StreamError("bad stream: data after [DONE]")
                    if payload == "[DONE]":
                        done = True
                        continue
                    try:
                        chunk = _decode_json(payload)
                    except ValueError:
                        raise StreamError(f"bad stream: not JSON: {payload[:80]!r}") from None
                    if not isinstance(chunk, dict):
                        raise StreamError(f"bad stream: not a JSON object: {payload[:80]!r}")
                    if isinstance(chunk.get("usage"), dict):
                        usage.update(chunk["usage"])
                    if isinstance(chunk.get(TIMELINE_FIELD), dict):
                        timeline.update(chunk[TIMELINE_FIELD])
                    text, carries = chunk_output(chunk)
                    if carries:
                        times.append(now)
                        pieces.append(text)
            if not done:
                raise StreamError("bad stream: ended without [DONE]")
            if not times:
                raise StreamError("bad stream: no output tokens")


def _error_message(raw: bytes) -> str:
    try:
        data = json.loads(raw)
        error = data.get("error", data) if isinstance(data, dict) else data
        message = error.get("message", error) if isinstance(error, dict) else error
        return str(message)[:_ERROR_BODY_LIMIT]
    except ValueError:
        return raw.decode("utf-8", "replace").strip()[:_ERROR_BODY_LIMIT] or "(empty body)"
