"""A real OpenAI-compatible streaming server with controlled timing and faults, for testing
and benchmarking the bench client: it answers /v1/chat/completions and /v1/completions
with one SSE chunk per token after a set TTFT and inter-token delay, and on chosen
requests (every Nth) fails with HTTP 500, streams garbage, stalls mid-answer or hangs.

Run: python -m tests.bench.fake_openai_server --port PORT [--ttft S] [--itl S] ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "fake-model"


@dataclass(frozen=True)
class FakeBehaviour:
    ttft: float = 0.0
    itl: float = 0.0
    fail_every: int = 0
    garbage_every: int = 0
    stall_every: int = 0
    stall: float = 0.0
    hang_every: int = 0
    usage: bool = True
    events_per_write: int = 1  # > 1 packs token events into one write, ignoring itl and faults


def _hit(every: int, number: int) -> bool:
    return every > 0 and number % every == 0


def build_app(behaviour: FakeBehaviour) -> FastAPI:
    app = FastAPI()
    counts = {"requests": 0, "in_flight": 0, "max_in_flight": 0}
    seen: list[dict] = []  # per request: its number, message roles and the max_tokens asked

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/stats")
    async def stats() -> dict:
        return {**counts, "seen": seen}

    @app.post("/reset")
    async def reset() -> dict:
        counts.update(requests=0, in_flight=0, max_in_flight=0)
        seen.clear()
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]}

    async def generate(request: Request, chat: bool):
        counts["requests"] += 1
        number = counts["requests"]
        body = await request.json()
        roles = [m.get("role") for m in body["messages"]] if chat else None
        seen.append({"number": number, "roles": roles, "body": body})
        if _hit(behaviour.fail_every, number):
            error = {"message": "injected failure", "type": "InternalServerError", "param": None, "code": 500}
            return JSONResponse({"error": error}, status_code=500)
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        if chat:
            prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in body["messages"])
        else:
            prompt_tokens = len(str(body["prompt"]).split())
        include_usage = behaviour.usage and (body.get("stream_options") or {}).get("include_usage")
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list, usage: dict | None = None) -> bytes:
            chunk = {"id": f"req-{number}", "object": kind, "model": MODEL, "choices": choices}
            if usage is not None:
                chunk["usage"] = usage
            return b"data: " + json.dumps(chunk).encode() + b"\n\n"

        token_chunk = event(
            [{"index": 0, "delta": {"content": "tok "}} if chat else {"index": 0, "text": "tok "}]
        )

        async def stream() -> AsyncIterator[bytes]:
            counts["in_flight"] += 1
            counts["max_in_flight"] = max(counts["max_in_flight"], counts["in_flight"])
            try:
                async for piece in answer():
                    yield piece
            finally:
                counts["in_flight"] -= 1

        async def answer() -> AsyncIterator[bytes]:
            if _hit(behaviour.hang_every, number):
                await asyncio.sleep(3600)
            if chat:
                yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}}])
            if behaviour.ttft:
                await asyncio.sleep(behaviour.ttft)
            packed = behaviour.events_per_write  # speed tests: no delays or faults in this mode
            for index in range(0, max_tokens if packed > 1 else 0, packed):
                yield token_chunk * min(packed, max_tokens - index)
            for index in range(max_tokens if packed == 1 else 0):
                if index and behaviour.itl:
                    await asyncio.sleep(behaviour.itl)
                if index == max_tokens // 2 and _hit(behaviour.stall_every, number):
                    await asyncio.sleep(behaviour.stall)
                if index == 2 and _hit(behaviour.garbage_every, number):
                    yield b"data: {this is not json\n\n"
                    return
                yield token_chunk
            finish = (
                {"index": 0, "delta": {}, "finish_reason": "length"}
                if chat
                else {"index": 0, "text": "", "finish_reason": "length"}
            )
            yield event([finish])
            if include_usage:
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": max_tokens,
                    "total_tokens": prompt_tokens + max_tokens,
                }
                yield event([], usage)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttft", type=float, default=0.0)
    parser.add_argument("--itl", type=float, default=0.0)
    parser.add_argument("--fail-every", type=int, default=0)
    parser.add_argument("--garbage-every", type=int, default=0)
    parser.add_argument("--stall-every", type=int, default=0)
    parser.add_argument("--stall", type=float, default=0.0)
    parser.add_argument("--hang-every", type=int, default=0)
    parser.add_argument("--no-usage", action="store_true")
    parser.add_argument("--events-per-write", type=int, default=1)
    args = parser.parse_args()
    behaviour = FakeBehaviour(
        ttft=args.ttft,
        itl=args.itl,
        fail_every=args.fail_every,
        garbage_every=args.garbage_every,
        stall_every=args.stall_every,
        stall=args.stall,
        hang_every=args.hang_every,
        usage=not args.no_usage,
        events_per_write=args.events_per_write,
    )
    uvicorn.run(build_app(behaviour), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
