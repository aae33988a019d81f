"""The demo model end to end: `splitserve serve` and `splitserve up` with no model serve
SmolLM2-135M-Instruct, which answers through the openai client (greedy) with Paris, as
plain content, and P/D gives the token IDs the collocated server gives."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import free_port, running_servers

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# Long enough (with the template's system prompt) to go through the prefill pool.
LONGER = [
    {"role": "system", "content": "You answer in one short sentence. " * 8},
    {"role": "user", "content": "Which river flows through Paris?"},
]


def token_ids(base: str, messages: list[dict]) -> list[int]:
    body = {"messages": messages, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def assert_answers_paris(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    [model] = client.models.list().data
    assert model.id == "SmolLM2-135M-Instruct"
    reply = client.chat.completions.create(model=model.id, messages=QUESTION, max_tokens=32, temperature=0)
    message = reply.choices[0].message
    assert "Paris" in message.content
    assert reply.choices[0].finish_reason == "stop"
    # no <think> or <tool_call> in SmolLM2's vocabulary: no parser, plain content
    assert getattr(message, "reasoning_content", None) is None and not message.tool_calls
    stream = client.chat.completions.create(
        model=model.id, messages=QUESTION, max_tokens=32, temperature=0, stream=True
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == message.content


UP_ARGS = ["up", "--num-blocks", "256", "--min-prefill-tokens", "16", "--pd-decision", "threshold"]


@pytest.fixture(scope="module")
def demo_servers(demo_home: Path) -> Iterator[tuple[str, str]]:
    """`serve` and `up` with no model, started side by side: (collocated, up)."""
    serve_port, up_port = free_port(), free_port()
    servers = [
        (["serve", "--port", str(serve_port), "--num-blocks", "256"], serve_port),
        ([*UP_ARGS, "--port", str(up_port)], up_port),
    ]
    with running_servers(servers, timeout=240, env={"SPLITSERVE_HOME": str(demo_home)}) as (collocated, up):
        yield collocated, up


def test_serve_without_a_model_answers_paris(demo_servers):
    collocated, _ = demo_servers
    assert_answers_paris(collocated)


def test_up_without_a_model_answers_paris_with_the_collocated_token_ids(demo_servers):
    collocated, base = demo_servers
    assert_answers_paris(base)
    for messages in (QUESTION, LONGER):
        assert token_ids(base, messages) == token_ids(collocated, messages)
    pd_requests = re.search(
        r'^splitserve_proxy_requests_total\{path="pd_push"\} (\S+)$',
        httpx.get(f"{base}/metrics").text,
        re.M,
    )
    assert pd_requests and float(pd_requests.group(1)) >= 2  # prefilled by the prefill engine
