"""The proxy's --routing policies over real engines: one `splitserve up --prefill 0
--decode 2 --routing round-robin`, plus text-prefix and cache-aware proxies started by
hand over the same render tier and engines (the same caches, so the policies can be
compared on one state). Cache-aware routing weighs a worker's cached prefix against its
load: prompt tokens queued for prefill there, as the engine reports them."""

from __future__ import annotations

import contextlib
import os
import random
import re
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from splitserve.runtime.access import INTERNAL_TOKEN_ENV
from tests.conftest import free_port, running_server
from tests.router.test_kv_routing import served, served_by, text

# The load test's blocker holds its blocks this long from its reservation: the test's steps
# up to its last routing check take ~1 s (8x that to spare); then it waits for the rest.
RESERVATION_TTL_S = 8


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
    # a reservation whose KV never comes holds its blocks this long (the load test's blocker)
    args += [
        "--num-blocks",
        "256",
        "--routing",
        "round-robin",
        "--kv-reservation-ttl",
        str(RESERVATION_TTL_S),
    ]
    with running_server(args, port, timeout=180, env=env) as base:
        parts = up_parts(port)
        yield Stack(base, parts["render"], [parts["decode-0"], parts["decode-1"]], env)


@contextlib.contextmanager
def proxy(stack: Stack, routing: str, *extra: str) -> Iterator[str]:
    port = free_port()
    args = ["proxy", "--render", stack.render, "--decode", *stack.decodes, "--port", str(port)]
    with running_server(
        [*args, "--routing", routing, "--health-interval", "0.5", *extra], port, env=stack.env
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


def wait_idle(base: str, url: str, timeout_s: float = 30) -> None:
    """Until the load the proxy weighs for `url` shows nothing queued or running: a report
    polled while a request ran stays until the next poll."""
    deadline = time.monotonic() + timeout_s
    while True:
        view = worker_view(base, url)
        if view["queued_prefill_tokens"] == 0 and view["running_decode_blocks"] == 0:
            return
        assert time.monotonic() < deadline, f"the proxy never saw {url} idle: {view}"
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
        wait_idle(cache_aware, token_worker)  # a load report polled mid-request has aged out
        # the same state, two answers: cache-aware goes where the system prompt's KV is
        worker, response = routed(cache_aware, probe)
        assert worker == token_worker and cached_tokens(response) > 0
        # text-prefix goes where it saw the identical text, and recomputes the whole prompt
        worker, response = routed(text_prefix, probe)
        assert worker == text_worker and cached_tokens(response) == 0


def token_ids(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 1800) for _ in range(count)]


def complete(base: str, prompt: list[int]) -> None:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text


def worker_view(base: str, url: str) -> dict:
    """The proxy's view of one worker: its /workers entry and the load it weighs."""
    state = httpx.get(f"{base}/workers").json()
    (worker,) = [w for w in state["workers"] if w["url"] == url]
    return {**worker, **state["load"][url]}


def wait_for(condition, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


class Background:
    """Requests sent on threads (each waits for its answer) and joined at the end."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def send(self, call, *args) -> None:
        thread = threading.Thread(target=call, args=args, daemon=True)
        thread.start()
        self.threads.append(thread)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=120)
            assert not thread.is_alive()


def test_cache_aware_weighs_the_cached_prefix_against_the_queued_prefill(stack: Stack) -> None:
    """One worker holds a 20-block prefix and cannot compute (a request waiting for remote
    KV holds nearly all its blocks for the reservation TTL), so whatever it is sent queues.
    A modest queue there (150 tokens, ~9 blocks) still loses to the 20 cached blocks; a
    long one (1650 tokens) sends the next request to the idle worker, which holds none of
    the prefix."""
    headers = {"Authorization": f"Bearer {stack.env[INTERNAL_TOKEN_ENV]}"}
    prefix = token_ids(50, 320)  # 20 blocks

    def direct(url: str, request_id: str, prompt: list[int], kv_transfer_params: dict | None = None) -> None:
        body = {"request_id": request_id, "token_ids": prompt, "sampling_params": {"max_tokens": 1}}
        if kv_transfer_params:
            body["kv_transfer_params"] = kv_transfer_params
        httpx.post(f"{url}/inference/v1/generate", json=body, headers=headers, timeout=120)

    with proxy(stack, "cache-aware", "--load-interval", "0.1") as base:
        holder = served_by(base, lambda: complete(base, [*prefix, 7]))
        idle = next(url for url in stack.decodes if url != holder)
        wait_indexed_more(base, holder, 0)
        background = Background()
        try:
            # 3999 positions reserved for KV that never comes: 250 of the 256 blocks
            background.send(
                direct, holder, "blocker", [*prefix, *token_ids(51, 3680)], {"do_remote_prefill": True}
            )
            wait_for(
                lambda: httpx.get(f"{holder}/inference/v1/stats", headers=headers).json()["num_waiting"] == 1,
                "the blocker never started waiting for its KV",
            )
            background.send(direct, holder, "queued-1", token_ids(52, 150))
            wait_for(lambda: worker_view(base, holder)["queued_prefill_tokens"] >= 150, "no load reported")
            assert worker_view(base, holder)["load_reported"]
            # modest load, large overlap: the holder (the request queues there)
            background.send(complete, base, [*prefix, *token_ids(53, 20)])
            wait_for(lambda: worker_view(base, holder)["in_flight"] == 1, "the probe went elsewhere")
            assert worker_view(base, idle)["served"] == 0
            # a long queue: the idle worker, although the holder has the prefix cached
            background.send(direct, holder, "queued-2", token_ids(54, 1500))
            wait_for(lambda: worker_view(base, holder)["queued_prefill_tokens"] >= 1650, "no load reported")
            assert served_by(base, lambda: complete(base, [*prefix, *token_ids(55, 20)])) == idle
        finally:
            # the blocker computes its prompt itself; its reserved blocks (a late push could
            # still land in them) come free at the reservation TTL, and the queue drains
            failed = {"request_id": "blocker", "error": "the test is over"}
            httpx.post(f"{holder}/inference/v1/kv/transfer_failed", json=failed, headers=headers)
            background.join()
        assert worker_view(base, holder)["served"] == 2 and worker_view(base, holder)["in_flight"] == 0
