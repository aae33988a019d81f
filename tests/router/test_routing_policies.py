"""The proxy's --routing policies over real engines: one `splitserve up --prefill 0
--decode 2 --routing round-robin`, plus text-prefix and cache-aware proxies started by
hand over the same render tier and engines (the same caches, so the policies can be
compared on one state)."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from splitserve.protocol.access import INTERNAL_TOKEN_ENV
from tests.conftest import free_port, running_server
from tests.router.test_kv_routing import served, text


class Stack(NamedTuple):
    base: str  # up's proxy (round-robin)
    render: str
    decodes: list[str]
    env: dict[str, str]  # the internal token the parts share


def up_parts(port: int, timeout_s: float = 30) -> dict[str, str]:
    """The parts `up` printed, by name: their URLs."""
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"splitserve-test-{port}.log"
    deadline = time.monotonic() + timeout_s
    while "OpenAI API:" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    return dict(re.findall(r"^\s+(\S+)\s+(http://\S+)\s+\(pid \d+\)", log.read_text(), re.M))


@pytest.fixture(scope="module")
def stack(tiny_model: str) -> Iterator[Stack]:
    port = free_port()
    env = {INTERNAL_TOKEN_ENV: secrets.token_urlsafe(16)}
    args = ["up", tiny_model, "--port", str(port), "--prefill", "0", "--decode", "2"]
    args += ["--num-blocks", "256", "--routing", "round-robin"]
    with running_server(args, port, timeout=180, env=env) as base:
        parts = up_parts(port)
        yield Stack(base, parts["render"], [parts["decode-0"], parts["decode-1"]], env)


@contextlib.contextmanager
def proxy(stack: Stack, routing: str) -> Iterator[str]:
    port = free_port()
    args = ["proxy", "--render", stack.render, "--decode", *stack.decodes, "--port", str(port)]
    with running_server(
        [*args, "--routing", routing, "--health-interval", "0.5"], port, env=stack.env
    ) as base:
        yield base


def chat(base: str, messages: list[dict]) -> dict:
    body = {"messages": messages, "max_tokens": 2, "temperature": 0}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def cached_tokens(response: dict) -> int:
    return (response["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def routed(base: str, messages: list[dict]) -> tuple[str, dict]:
    """The worker the proxy at `base` sent the chat to, and the response."""
    before = served(base)
    response = chat(base, messages)
    after = served(base)
    (url,) = [u for u in after if after[u] != before[u]]
    return url, response


def indexed_blocks(base: str, url: str) -> int:
    return httpx.get(f"{base}/workers").json()["kv_index_blocks"].get(url, 0)


def wait_indexed_more(base: str, url: str, than: int, timeout_s: float = 30) -> None:
    """Until the proxy's index holds more of `url`'s blocks than `than` (events are async)."""
    deadline = time.monotonic() + timeout_s
    while indexed_blocks(base, url) <= than:
        assert time.monotonic() < deadline, f"the proxy never indexed {url}'s new blocks"
        time.sleep(0.1)


def test_round_robin_alternates_even_for_a_repeated_prompt(stack: Stack) -> None:
    assert httpx.get(f"{stack.base}/workers").json()["routing"] == "round-robin"  # up passed it on
    messages = [{"role": "system", "content": text(10, 60)}, {"role": "user", "content": text(11, 10)}]
    picks = [routed(stack.base, messages)[0] for _ in range(4)]
    # cache-aware would keep the repeated prompt on the worker that holds it
    assert picks[0] != picks[1] and picks[2:] == picks[:2], picks


def test_text_prefix_follows_the_longest_common_text(stack: Stack) -> None:
    instructions = "You are a librarian. " + text(20, 60)
    with proxy(stack, "text-prefix") as base:
        first, _ = routed(base, [{"role": "user", "content": instructions}])
        for i in range(3):  # least-loaded would rotate; the shared text keeps them together
            follow_up = [
                {"role": "system", "content": instructions},
                {"role": "user", "content": text(21 + i, 8)},
            ]
            assert routed(base, follow_up)[0] == first
        # no text in common: least-loaded, the worker that served fewer
        assert routed(base, [{"role": "user", "content": "Hi " + text(30, 30)}])[0] != first


def test_cache_aware_follows_the_tokens_where_text_prefix_follows_the_text(stack: Stack) -> None:
    """Instructions sent as the user message on one worker, as the system message on the
    other: a probe with the first one's exact text but the second one's token prefix."""
    instructions, question, other = "You are a tax advisor. " + text(40, 80), text(41, 12), text(42, 12)
    as_user = [{"role": "user", "content": instructions + question}]
    as_system = [{"role": "system", "content": instructions}, {"role": "user", "content": other}]
    probe = [{"role": "system", "content": instructions}, {"role": "user", "content": question}]
    with proxy(stack, "text-prefix") as text_prefix, proxy(stack, "cache-aware") as cache_aware:
        text_worker, _ = routed(text_prefix, as_user)
        # cache-aware sends the same request there too (it holds those tokens; equal costs
        # before their events land pick the first worker, as text-prefix did), so that
        # as_system, cached nowhere, goes to the worker it has used less
        assert routed(cache_aware, as_user)[0] == text_worker
        token_worker = next(url for url in stack.decodes if url != text_worker)
        before = indexed_blocks(cache_aware, token_worker)
        assert routed(cache_aware, as_system)[0] == token_worker
        wait_indexed_more(cache_aware, token_worker, before)
        # the same state, two answers: cache-aware goes where the system prompt's KV is
        worker, response = routed(cache_aware, probe)
        assert worker == token_worker and cached_tokens(response) > 0
        # text-prefix goes where it saw the identical text, and recomputes the whole prompt
        worker, response = routed(text_prefix, probe)
        assert worker == text_worker and cached_tokens(response) == 0
