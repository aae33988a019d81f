"""Bad input to the engine HTTP API: every case gets an OpenAI-style 4xx and the engine
keeps serving, in-process and against a real `splitserve engine` process."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from splitserve.engine.api.app import create_engine_app
from splitserve.engine.async_engine import AsyncEngine
from tests.conftest import free_port, running_server, wait_until
from tests.engine.api.helpers import (
    BLOCK_SIZE,
    GENERATE,
    MAX_MODEL_LEN,
    NUM_BLOCKS,
    VOCAB,
    asgi_client,
    assert_openai_error,
    metric_samples,
    prompt,
    run,
)

LONG_BUDGET = [1] * 1100  # fits max_model_len (1536), never fits 64 blocks of 16
BAD_GENERATE_BODIES = [
    pytest.param(b"{not json", 400, None, id="malformed-json"),
    pytest.param(b"\xff\xfe", 400, None, id="not-utf8"),
    pytest.param([1, 2, 3], 400, None, id="body-not-object"),
    pytest.param("a string", 400, None, id="body-string"),
    pytest.param({}, 400, "token_ids", id="missing-token-ids"),
    pytest.param({"token_ids": []}, 400, "token_ids", id="empty-prompt"),
    pytest.param({"token_ids": "1 2 3"}, 400, "token_ids", id="token-ids-string"),
    pytest.param({"token_ids": [1, -5, 2]}, 400, "token_ids", id="negative-token"),
    pytest.param({"token_ids": [1, VOCAB]}, 400, "token_ids", id="out-of-vocab"),
    pytest.param({"token_ids": [1, 2.5]}, 400, "token_ids", id="float-token"),
    pytest.param({"token_ids": [1, True]}, 400, "token_ids", id="bool-token"),
    pytest.param({"token_ids": [1] * (MAX_MODEL_LEN + 1)}, 413, None, id="longer-than-model"),
    pytest.param({"token_ids": LONG_BUDGET}, 413, None, id="longer-than-kv-budget"),
    pytest.param({"token_ids": [1], "prompt": "hi"}, 400, "prompt", id="unknown-field"),
    pytest.param(
        {"token_ids": [1], "sampling_params": [0.5]}, 400, "sampling_params", id="sampling-not-object"
    ),
    pytest.param(
        {"token_ids": [1], "sampling_params": {"temprature": 0.5}},
        400,
        "sampling_params.temprature",
        id="unknown-sampling-field",
    ),
    pytest.param(
        {"token_ids": [1], "sampling_params": {"temperature": -1}},
        400,
        "sampling_params.temperature",
        id="negative-temperature",
    ),
    pytest.param(
        {"token_ids": [1], "sampling_params": {"top_p": 0}}, 400, "sampling_params.top_p", id="zero-top-p"
    ),
    pytest.param(
        {"token_ids": [1], "sampling_params": {"top_k": -3}}, 400, "sampling_params.top_k", id="bad-top-k"
    ),
    pytest.param(
        {"token_ids": [1], "sampling_params": {"preceding_output_tokens": -1}},
        400,
        "sampling_params.preceding_output_tokens",
        id="negative-preceding-output-tokens",
    ),
    pytest.param(
        {"token_ids": [1], "sampling_params": {"max_tokens": 0}},
        400,
        "sampling_params.max_tokens",
        id="zero-max-tokens",
    ),
    pytest.param(
        {"token_ids": [1], "sampling_params": {"max_tokens": "10"}},
        400,
        "sampling_params.max_tokens",
        id="string-max-tokens",
    ),
    pytest.param(
        {"token_ids": [1], "sampling_params": {"logprobs": 99}},
        400,
        "sampling_params.logprobs",
        id="too-many-logprobs",
    ),
    pytest.param(
        {"token_ids": [1], "sampling_params": {"seed": "x"}}, 400, "sampling_params.seed", id="string-seed"
    ),
    pytest.param(
        {"token_ids": [1], "sampling_params": {"stop_token_ids": [-1]}},
        400,
        "sampling_params.stop_token_ids",
        id="negative-stop-token",
    ),
    pytest.param({"token_ids": [1], "sampling_params": {"n": 2}}, 400, "sampling_params.n", id="vllm-n-2"),
    pytest.param(
        {"token_ids": [1], "sampling_params": {"stop": ["x"]}},
        400,
        "sampling_params.stop",
        id="vllm-stop-strings",
    ),
    pytest.param({"token_ids": [1], "output_mode": "text"}, 400, "output_mode", id="vllm-text-mode"),
    pytest.param({"token_ids": [1], "stream": "yes"}, 400, "stream", id="stream-not-bool"),
    pytest.param(
        {"token_ids": [1], "stream_options": {"usage": True}}, 400, None, id="unknown-stream-option"
    ),
    pytest.param({"token_ids": [1], "cache_salt": ""}, 400, "cache_salt", id="empty-cache-salt"),
    pytest.param({"token_ids": [1], "request_id": 5}, 400, "request_id", id="request-id-not-string"),
    pytest.param(
        {"token_ids": [1], "kv_transfer_params": [1]}, 400, "kv_transfer_params", id="kv-params-list"
    ),
    pytest.param({"token_ids": [1], "features": {"mm_hashes": {}}}, 400, "features", id="features"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_GENERATE_BODIES)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_bad_generate_requests(
    engine: AsyncEngine, body, status: int, param: str | None, stream: bool
) -> None:
    app = create_engine_app(engine, max_model_len=MAX_MODEL_LEN)
    if stream and isinstance(body, dict):
        body = {**body, "stream": body.get("stream", True)}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with asgi_client(app) as client:
            bad = await client.post(GENERATE, content=content, headers={"content-type": "application/json"})
            good = await client.post(
                GENERATE, json={"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}}
            )
            return bad, good

    bad, good = run(go())
    assert_openai_error(bad, status, param)
    assert good.status_code == 200 and len(good.json()["choices"][0]["token_ids"]) <= 2
    assert engine.stats().num_running == 0


# -- against a real `splitserve engine` process ------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model: str) -> Iterator[str]:
    port = free_port()
    args = [
        "engine",
        tiny_model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--block-size",
        str(BLOCK_SIZE),
        "--num-blocks",
        str(NUM_BLOCKS),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-batched-tokens",
        "128",
        "--log-level",
        "warning",
    ]
    with running_server(args, port) as base:
        yield base


ABORTED = ("splitserve_request_success_total", (("finish_reason", "abort"),))


def _wait_idle(client: httpx.Client, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = client.get("/inference/v1/stats").json()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_usage"] == 0:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def test_server_keeps_streaming_while_bad_requests_are_rejected(server: str) -> None:
    long_body = {
        "token_ids": prompt(31, 50),
        "sampling_params": {"max_tokens": 600, "ignore_eos": True, "temperature": 0},
    }
    with (
        httpx.Client(base_url=server, timeout=60) as client,
        httpx.Client(base_url=server, timeout=60) as other,
    ):
        expected = client.post(GENERATE, json=long_body).json()["choices"][0]["token_ids"]
        streamed: list[int] = []
        rejected = concurrent = 0
        with client.stream("POST", GENERATE, json={**long_body, "stream": True}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[len("data: ") :])
                streamed += chunk["choices"][0]["token_ids"]
                if rejected < len(BAD_GENERATE_BODIES) and len(streamed) % 8 == 0:
                    body, status, _ = BAD_GENERATE_BODIES[rejected].values
                    content = body if isinstance(body, bytes) else json.dumps(body).encode()
                    bad = other.post(GENERATE, content=content, headers={"content-type": "application/json"})
                    assert_openai_error(bad, status)
                    rejected += 1
                    concurrent += other.get("/inference/v1/stats").json()["num_running"]
        assert rejected == len(BAD_GENERATE_BODIES)
        assert streamed == expected
        assert len(streamed) == 600
        assert concurrent > 0  # the long request was running while bad ones were rejected
        _wait_idle(client)


def test_server_client_disconnect_frees_blocks(server: str) -> None:
    body = {"token_ids": prompt(41, 40), "sampling_params": {"max_tokens": 900, "ignore_eos": True}}
    with httpx.Client(base_url=server, timeout=60) as client:
        total = client.get("/inference/v1/stats").json()["num_blocks_total"]
        aborted_before = metric_samples(client.get("/metrics").text).get(ABORTED, 0)
        with httpx.Client(base_url=server, timeout=60) as streamer:
            with streamer.stream("POST", GENERATE, json={**body, "stream": True}) as response:
                events = 0
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events += 1
                    if events == 3:
                        break
            assert client.get("/inference/v1/stats").json()["num_running"] <= 1
        stats = _wait_idle(client)
        assert stats["num_blocks_free"] == total

        # A non-streaming client that gives up is aborted too. It hangs up once the engine
        # runs its request (a client timeout would race the tiny model's whole answer).
        url = httpx.URL(server)
        payload = json.dumps(body).encode()
        head = f"POST {GENERATE} HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
        with socket.create_connection((url.host, url.port)) as impatient:
            impatient.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            assert wait_until(lambda: client.get("/inference/v1/stats").json()["num_running"] > 0, 30)
        stats = _wait_idle(client)
        assert stats["num_blocks_free"] == total

        # The engine frees an aborted request's blocks before the HTTP handler that saw the
        # client go counts it: wait for the count, then check it went no further.
        def samples() -> dict:
            return metric_samples(client.get("/metrics").text)

        assert wait_until(lambda: samples().get(ABORTED, 0) >= aborted_before + 2, 30)
        metrics = samples()
        assert metrics[ABORTED] == aborted_before + 2  # neither request ran to its end
        assert metrics[("splitserve_num_requests_running", ())] == 0
