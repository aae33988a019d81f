"""Both EngineClient implementations: in-process over AsyncEngine, and HTTP against a real
`splitserve engine`; they must yield the same chunks' tokens and map errors alike."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import httpx
import pytest

from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from splitserve.engine.api.local_client import LocalEngineClient
from splitserve.engine.async_engine import AsyncEngine
from splitserve.protocol.engine_client import EngineClient
from splitserve.protocol.errors import APIError
from splitserve.runtime.http_engine_client import HTTPEngineClient
from tests.conftest import free_port, running_server, wire_request

VOCAB = 2048
NUM_BLOCKS = 48
MAX_MODEL_LEN = 1024


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


@pytest.fixture(scope="module")
def engine(tiny_model: str) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(
        EngineConfig(
            model=ModelConfig(model=tiny_model),
            cache=CacheConfig(num_blocks=NUM_BLOCKS),
            scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN),
        )
    )
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def server(tiny_model: str) -> Iterator[str]:
    port = free_port()
    args = [
        "engine",
        tiny_model,
        "--port",
        str(port),
        "--num-blocks",
        str(NUM_BLOCKS),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--log-level",
        "warning",
    ]
    with running_server(args, port) as base:
        yield base


REQUESTS = [
    {"token_ids": prompt(1, 30), "sampling_params": {"temperature": 0, "max_tokens": 12, "ignore_eos": True}},
    {
        "token_ids": prompt(2, 70),
        "sampling_params": {"temperature": 1.0, "top_k": 20, "seed": 99, "max_tokens": 9, "ignore_eos": True},
    },
    {"token_ids": prompt(3, 5), "sampling_params": {"temperature": 0, "max_tokens": 6, "logprobs": 1}},
]


async def collect(client: EngineClient, request: dict) -> list[dict]:
    return [chunk async for chunk in client.generate(wire_request(request))]


def check_chunks(chunks: list[dict], request: dict) -> list[int]:
    assert chunks, "no chunks"
    final = chunks[-1]
    choice = final["choices"][0]
    assert choice["finish_reason"] in ("length", "stop")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    tokens = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert final["usage"]["prompt_tokens"] == len(request["token_ids"])
    assert final["usage"]["completion_tokens"] == len(tokens)
    assert "kv_transfer_params" in final
    if request["sampling_params"].get("logprobs") is not None:
        logged = [e["token_id"] for c in chunks for e in c["choices"][0]["logprobs"]["content"]]
        assert logged == tokens
    return tokens


async def errors_of(client: EngineClient) -> list[tuple[int, str | None]]:
    bad_requests = [
        {"token_ids": []},
        {"token_ids": [VOCAB + 1]},
        {"token_ids": [1] * (MAX_MODEL_LEN + 5)},
        {"token_ids": [1], "sampling_params": {"top_p": 7}},
        {"token_ids": [1], "bogus": True},
    ]
    found = []
    for request in bad_requests:
        with pytest.raises(APIError) as info:
            await collect(client, request)
        found.append((info.value.status, info.value.param))
    return found


EXPECTED_ERRORS = [
    (400, "token_ids"),
    (400, "token_ids"),
    (413, None),
    (400, "sampling_params.top_p"),
    (400, "bogus"),
]


def test_local_and_http_clients_agree(engine: AsyncEngine, server: str) -> None:
    async def go() -> tuple[list[list[int]], list[list[int]], list, list, bool, bool]:
        local = LocalEngineClient(engine, max_model_len=MAX_MODEL_LEN)
        remote = HTTPEngineClient(server)
        try:
            local_tokens = [check_chunks(await collect(local, r), r) for r in REQUESTS]
            results = await asyncio.gather(*(collect(remote, r) for r in REQUESTS))
            remote_tokens = [check_chunks(chunks, r) for chunks, r in zip(results, REQUESTS, strict=True)]
            return (
                local_tokens,
                remote_tokens,
                await errors_of(local),
                await errors_of(remote),
                await local.check_health(),
                await remote.check_health(),
            )
        finally:
            await remote.close()

    local_tokens, remote_tokens, local_errors, remote_errors, local_ok, remote_ok = asyncio.run(go())
    assert local_tokens == remote_tokens
    assert [len(t) for t in local_tokens[:2]] == [12, 9]
    assert [status for status, _ in local_errors] == [status for status, _ in EXPECTED_ERRORS]
    assert local_errors == remote_errors
    for (status, param), (want_status, want_param) in zip(local_errors, EXPECTED_ERRORS, strict=True):
        assert status == want_status
        if want_param is not None:
            assert param == want_param
    assert local_ok and remote_ok


def _wait_idle(stats, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        current = stats()
        if current["num_running"] == 0 and current["num_waiting"] == 0:
            return
        assert time.monotonic() < deadline, current
        time.sleep(0.05)


def test_closing_either_client_early_aborts(engine: AsyncEngine, server: str) -> None:
    long_request = {"token_ids": prompt(5, 20), "sampling_params": {"max_tokens": 600, "ignore_eos": True}}

    async def read_three_then_close(client: EngineClient) -> int:
        chunks = client.generate(wire_request(long_request))
        received = 0
        async for _ in chunks:
            received += 1
            if received == 3:
                break
        await chunks.aclose()
        return received

    async def go() -> None:
        remote = HTTPEngineClient(server)
        try:
            assert await read_three_then_close(LocalEngineClient(engine)) == 3
            assert await read_three_then_close(remote) == 3
        finally:
            await remote.close()

    asyncio.run(go())
    _wait_idle(lambda: engine.stats()._asdict())
    assert engine.stats().kv_usage == 0
    _wait_idle(lambda: httpx.get(f"{server}/inference/v1/stats").json())


def test_abort_through_clients(engine: AsyncEngine, server: str) -> None:
    async def abort_midway(client: EngineClient) -> dict:
        request = {
            "request_id": "to-abort",
            "token_ids": prompt(6, 20),
            "sampling_params": {"max_tokens": 800, "ignore_eos": True},
        }
        chunks = []
        async for chunk in client.generate(wire_request(request)):
            chunks.append(chunk)
            if len(chunks) == 2:
                await client.abort(["to-abort", "unknown-id"])
        return chunks[-1]

    async def go() -> tuple[dict, dict]:
        remote = HTTPEngineClient(server)
        try:
            return await abort_midway(LocalEngineClient(engine)), await abort_midway(remote)
        finally:
            await remote.close()

    local_final, remote_final = asyncio.run(go())
    for final in (local_final, remote_final):
        assert final["choices"][0]["finish_reason"] == "abort"
        assert final["usage"]["completion_tokens"] < 800


def test_http_client_unreachable_engine() -> None:
    async def go() -> tuple[bool, APIError]:
        client = HTTPEngineClient(f"http://127.0.0.1:{free_port()}")
        try:
            healthy = await client.check_health()
            with pytest.raises(APIError) as info:
                await collect(client, {"token_ids": [1, 2, 3]})
            return healthy, info.value
        finally:
            await client.close()

    healthy, error = asyncio.run(go())
    assert not healthy
    assert error.status == 503


def test_stopped_engine_answers_503(tiny_model: str) -> None:
    from splitserve.engine.api.app import create_engine_app

    stopped = AsyncEngine(EngineConfig(model=ModelConfig(model=tiny_model), cache=CacheConfig(num_blocks=8)))
    try:
        client = LocalEngineClient(stopped)
        app = create_engine_app(stopped)

        async def go() -> tuple[bool, APIError, httpx.Response, httpx.Response]:
            with pytest.raises(APIError) as info:
                await collect(client, {"token_ids": [1, 2, 3]})
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://engine") as http:
                health = await http.get("/health")
                generate = await http.post("/inference/v1/generate", json={"token_ids": [1, 2, 3]})
            return await client.check_health(), info.value, health, generate

        healthy, error, health, generate = asyncio.run(go())
    finally:
        stopped.shutdown()
    assert not healthy
    assert error.status == 503
    assert health.status_code == 503 and generate.status_code == 503
    assert generate.json()["error"]["type"] == "service_unavailable"
