"""The engine HTTP API through httpx: in-process (ASGI) and against a `splitserve engine`."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from splitserve.engine.api.app import create_engine_app
from splitserve.engine.async_engine import AsyncEngine
from tests.conftest import wait_until
from tests.engine.api.helpers import (
    ABORT,
    GENERATE,
    MAX_MODEL_LEN,
    NUM_BLOCKS,
    VOCAB,
    asgi_client,
    assert_openai_error,
    joined_tokens,
    metric_samples,
    prompt,
    run,
    sse_chunks,
)

SAMPLINGS = [
    pytest.param({"temperature": 0.0}, id="greedy"),
    pytest.param({"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 1234}, id="seeded"),
]


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_streaming_and_non_streaming_agree(engine: AsyncEngine, sampling: dict) -> None:
    app = create_engine_app(engine, max_model_len=MAX_MODEL_LEN)
    params = {**sampling, "max_tokens": 24, "ignore_eos": True}

    async def both(token_ids: list[int]) -> tuple[dict, list[dict | str]]:
        async with asgi_client(app) as client:
            plain = await client.post(GENERATE, json={"token_ids": token_ids, "sampling_params": params})
            streamed = await client.post(
                GENERATE,
                json={
                    "token_ids": token_ids,
                    "sampling_params": params,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
        assert plain.status_code == 200, plain.text
        assert streamed.status_code == 200, streamed.text
        assert streamed.headers["content-type"].startswith("text/event-stream")
        return plain.json(), sse_chunks(streamed.text)

    async def many() -> list[tuple[dict, list[dict | str]]]:
        return await asyncio.gather(*(both(prompt(seed, 20 + 13 * seed)) for seed in range(3)))

    for seed, (plain, events) in enumerate(run(many())):
        num_prompt = 20 + 13 * seed
        choice = plain["choices"][0]
        assert choice["index"] == 0 and choice["finish_reason"] == "length"
        assert len(choice["token_ids"]) == 24
        assert all(0 <= t < VOCAB for t in choice["token_ids"])
        assert plain["usage"]["prompt_tokens"] == num_prompt
        assert plain["usage"]["completion_tokens"] == 24
        assert plain["usage"]["total_tokens"] == num_prompt + 24
        assert "kv_transfer_params" in plain
        assert plain["metrics"]["time_to_first_token_ms"] >= 0

        assert events[-1] == "[DONE]"
        chunks = [e for e in events if isinstance(e, dict)]
        assert joined_tokens(events) == choice["token_ids"]
        assert all(c["request_id"] == chunks[0]["request_id"] for c in chunks)
        assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        final = chunks[-1]
        assert final["choices"][0]["finish_reason"] == "length"
        assert "kv_transfer_params" in final
        assert final["usage"]["completion_tokens"] == 24
        assert all("usage" not in c for c in chunks[:-1])


def test_logprobs_stop_tokens_and_request_id(engine: AsyncEngine) -> None:
    app = create_engine_app(engine, max_model_len=MAX_MODEL_LEN)
    token_ids = prompt(7, 40)

    async def go() -> tuple[dict, dict, list[dict | str]]:
        async with asgi_client(app) as client:
            body = {
                "request_id": "lp-1",
                "token_ids": token_ids,
                "sampling_params": {"temperature": 0, "max_tokens": 8, "ignore_eos": True, "logprobs": 3},
            }
            plain = (await client.post(GENERATE, json=body)).json()
            streamed = await client.post(GENERATE, json={**body, "request_id": "lp-2", "stream": True})
            stop_at = plain["choices"][0]["token_ids"][3]
            stopped = await client.post(
                GENERATE,
                json={
                    "token_ids": token_ids,
                    "sampling_params": {"temperature": 0, "max_tokens": 8, "stop_token_ids": [stop_at]},
                },
            )
            return plain, stopped.json(), sse_chunks(streamed.text)

    plain, stopped, events = run(go())
    assert plain["request_id"] == "lp-1"
    choice = plain["choices"][0]
    content = choice["logprobs"]["content"]
    assert [entry["token_id"] for entry in content] == choice["token_ids"]
    for entry in content:
        assert entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 3
        # greedy: the sampled token is the most likely one
        assert entry["top_logprobs"][0]["token_id"] == entry["token_id"]
        assert [t["rank"] for t in entry["top_logprobs"]] == [1, 2, 3]
    streamed_content = [
        e for c in events if isinstance(c, dict) for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert [e["token_id"] for e in streamed_content] == choice["token_ids"]
    assert [e["logprob"] for e in streamed_content] == pytest.approx(
        [e["logprob"] for e in content], abs=1e-5
    )

    stop_at = choice["token_ids"][3]
    stopped_ids = stopped["choices"][0]["token_ids"]
    first = choice["token_ids"].index(stop_at)
    assert stopped_ids == choice["token_ids"][: first + 1]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["stop_reason"] == stop_at


# What `vllm launch render` (0.32) answered for a chat request, verbatim but for the IDs.
VLLM_RENDERED_CHAT = json.loads(
    '{"request_id":"chatcmpl-ba1a291f1c2aa8fd","token_ids":[1,503,201,1069,560,2,201,1,476,201],'
    '"token_offsets":null,"features":null,"content_parts":null,"sampling_params":{"presence_penalty":0.0,'
    '"frequency_penalty":0.0,"repetition_penalty":1.0,"temperature":0.0,"stop":[],"stop_token_ids":[],'
    '"max_tokens":5,"output_kind":2,"skip_clone":true,"bad_words":[],"skip_reading_prefix_cache":false},'
    '"model":"/models/bench","reasoning_ended":null,"reasoning_parser_kwargs":null,"return_token_ids":null,'
    '"output_mode":"tokens","stream":false,"stream_options":null,"cache_salt":null,"priority":0,'
    '"kv_transfer_params":null,"ec_transfer_params":null}'
)


def test_vllm_render_output_is_served(engine: AsyncEngine) -> None:
    """A generate request from vLLM's render tier (neutral extras included) is served."""
    app = create_engine_app(engine, max_model_len=MAX_MODEL_LEN)
    extras = {"n": 1, "top_k": 0, "min_p": 0.0, "min_tokens": 0, "detokenize": True, "logprobs": None}
    with_extras = {
        **VLLM_RENDERED_CHAT,
        "request_id": "with-extras",
        "return_token_ids": True,
        "sampling_params": {**VLLM_RENDERED_CHAT["sampling_params"], **extras},
    }

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with asgi_client(app) as client:
            return (
                await client.post(GENERATE, json=VLLM_RENDERED_CHAT),
                await client.post(GENERATE, json=with_extras),
            )

    plain, extra = run(go())
    assert plain.status_code == 200, plain.text
    assert plain.json()["request_id"] == VLLM_RENDERED_CHAT["request_id"]
    assert extra.status_code == 200, extra.text
    assert plain.json()["choices"][0]["token_ids"] == extra.json()["choices"][0]["token_ids"]
    assert len(plain.json()["choices"][0]["token_ids"]) == 5
    assert extra.json()["prompt_token_ids"] == VLLM_RENDERED_CHAT["token_ids"]


async def _wait_running(client: httpx.AsyncClient, count: int, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = (await client.get("/inference/v1/stats")).json()
        if stats["num_running"] + stats["num_waiting"] == count:
            return stats
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.02)


def test_duplicate_request_id_and_abort(engine: AsyncEngine) -> None:
    app = create_engine_app(engine, max_model_len=MAX_MODEL_LEN)
    long_body = {
        "request_id": "long-1",
        "token_ids": prompt(11, 30),
        "sampling_params": {"max_tokens": 900, "ignore_eos": True, "temperature": 0},
        "stream": True,
    }

    async def go() -> tuple[httpx.Response, httpx.Response, httpx.Response, httpx.Response, httpx.Response]:
        async with asgi_client(app) as client:
            long_task = asyncio.create_task(client.post(GENERATE, json=long_body))
            await _wait_running(client, 1)
            duplicate = await client.post(GENERATE, json={**long_body, "stream": False})
            unknown = await client.post(ABORT, json={"request_ids": ["nobody"]})
            malformed = await client.post(ABORT, json={"request_ids": "long-1"})
            aborted = await client.post(ABORT, json={"request_ids": ["long-1", "nobody"]})
            return duplicate, unknown, malformed, aborted, await long_task

    duplicate, unknown, malformed, aborted, long_response = run(go())
    assert_openai_error(duplicate, 400, "request_id")
    assert_openai_error(unknown, 404)
    assert_openai_error(malformed, 400, "request_ids")
    assert aborted.status_code == 200
    assert aborted.json() == {"aborted": ["long-1"], "unknown": ["nobody"]}
    events = sse_chunks(long_response.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    assert len(joined_tokens(events)) < 900
    # the stream ends as the abort is taken; the engine's stats snapshot follows at its next loop
    assert wait_until(lambda: engine.stats().num_running == 0), engine.stats()


def test_health_and_unknown_routes(engine: AsyncEngine) -> None:
    app = create_engine_app(engine, max_model_len=MAX_MODEL_LEN)

    async def go() -> tuple[httpx.Response, ...]:
        async with asgi_client(app) as client:
            return (
                await client.get("/health"),
                await client.get("/inference/v1/nothing"),
                await client.get(GENERATE),
            )

    health, missing, wrong_method = run(go())
    assert health.status_code == 200
    assert_openai_error(missing, 404)
    assert_openai_error(wrong_method, 405)


def test_metrics_count_requests_and_tokens(engine: AsyncEngine) -> None:
    app = create_engine_app(engine, max_model_len=MAX_MODEL_LEN)  # a fresh registry: counts start at 0
    shared = prompt(21, 64)
    lengths = [(shared, 6), ([*shared, 9, 9], 5), (prompt(22, 20), 7)]

    async def go() -> tuple[list[dict], str]:
        async with asgi_client(app) as client:
            results = []
            for token_ids, n in lengths:
                body = {"token_ids": token_ids, "sampling_params": {"max_tokens": n, "ignore_eos": True}}
                results.append((await client.post(GENERATE, json=body)).json())
            await client.post(GENERATE, json={"token_ids": []})  # rejected: counted as such
            return results, (await client.get("/metrics")).text

    results, text = run(go())
    s = metric_samples(text)
    assert s[("splitserve_request_success_total", (("finish_reason", "length"),))] == 3
    assert s[("splitserve_request_rejected_total", (("status", "400"),))] == 1
    assert s[("splitserve_generation_tokens_total", ())] == 6 + 5 + 7
    assert s[("splitserve_prompt_tokens_total", ())] == sum(len(t) for t, _ in lengths)
    assert s[("splitserve_time_to_first_token_seconds_count", ())] == 3
    assert s[("splitserve_inter_token_latency_seconds_count", ())] == 5 + 4 + 6
    assert s[("splitserve_e2e_request_latency_seconds_count", ())] == 3
    assert s[("splitserve_step_time_seconds_count", ())] >= 7
    assert s[("splitserve_num_requests_running", ())] == 0
    assert s[("splitserve_num_requests_waiting", ())] == 0
    assert 0 <= s[("splitserve_kv_cache_usage_perc", ())] <= 1
    assert s[("splitserve_kv_cache_blocks_total", ())] == NUM_BLOCKS
    # the second prompt shares 4 full blocks with the first
    assert results[1]["usage"]["cached_tokens"] == 64
    assert s[("splitserve_prefix_cache_hits_total", ())] >= 64
    assert 0 < s[("splitserve_prefix_cache_hit_rate", ())] <= 1
