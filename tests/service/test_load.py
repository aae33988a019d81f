"""Load through the whole stack: 64 concurrent streams through `splitserve up` (the tiny
model) all complete, none cut or refused, each with the tokens its prompt gives alone."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.conftest import free_port, running_server

STREAMS = 64
PROMPTS = [f"load test prompt number {i}, about the cache and the decode" for i in range(8)]


async def stream(client: httpx.AsyncClient, base: str, prompt: str) -> tuple[str, str | None]:
    """The text and finish reason of one streamed completion; an in-band error raises."""
    body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}
    text: list[str] = []
    finish_reason = None
    async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "choices" in event, line
                text.append(event["choices"][0]["text"])
                finish_reason = event["choices"][0].get("finish_reason") or finish_reason
    return "".join(text), finish_reason


async def run_streams(base: str) -> None:
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as client:
        expected = {p: await stream(client, base, p) for p in PROMPTS}
        results = await asyncio.gather(
            *(stream(client, base, PROMPTS[i % len(PROMPTS)]) for i in range(STREAMS)), return_exceptions=True
        )
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    for i, result in enumerate(results):
        assert result == expected[PROMPTS[i % len(PROMPTS)]]
        assert result[1] == "length"


def test_64_concurrent_streams_through_up_see_no_error(tiny_model):
    port = free_port()
    args = [
        "up",
        tiny_model,
        "--port",
        str(port),
        "--num-blocks",
        "1024",
        "--min-prefill-tokens",
        "8",
        "--pd-decision",
        "threshold",
    ]
    with running_server(args, port, timeout=180) as base:
        asyncio.run(run_streams(base))
