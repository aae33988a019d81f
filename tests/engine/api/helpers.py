"""Shared by the engine HTTP API tests: the tiny engine's shape, request and SSE helpers."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
from prometheus_client.parser import text_string_to_metric_families

from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

VOCAB = 2048  # the default tiny model's
BLOCK_SIZE = 16
NUM_BLOCKS = 64  # 1,024 tokens of KV: a 1,100-token prompt can never fit
MAX_MODEL_LEN = 1536
GENERATE = "/inference/v1/generate"
ABORT = "/inference/v1/abort_requests"


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def engine_config(model: str) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_batched_tokens=128, max_model_len=MAX_MODEL_LEN),
    )


def run(coro):
    return asyncio.run(coro)


def asgi_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine", timeout=60)


def sse_chunks(text: str) -> list[dict | str]:
    """The events of an SSE body: dicts, and the closing "[DONE]"."""
    events: list[dict | str] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def joined_tokens(events: list[dict | str]) -> list[int]:
    return [t for e in events if isinstance(e, dict) for c in e["choices"] for t in c["token_ids"]]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples
