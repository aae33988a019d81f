"""Retention: a finished request's cached blocks are prefix hits for --kv-retention-ttl
seconds, never after (the engine's KV events report them removed), and a block whose TTL
has not run out still gives way under memory pressure."""

from __future__ import annotations

import time

import httpx

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.request import Request
from splitserve.protocol.block_hash import compute_block_hashes
from splitserve.protocol.kv_events import BlockRemoved
from splitserve.runtime.kv_events import KVEventSubscriber
from tests.conftest import free_port, running_server
from tests.generate_requests import generate_request

BLOCK = 4


def generate(url: str, prompt: list[int]) -> tuple[list[int], int]:
    """The answer's tokens and cached prompt tokens (checked against the per-request
    metrics: reused locally + computed here = the prompt, nothing received)."""
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 4, "temperature": 0}}
    response = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    metrics = answer["metrics"]
    assert metrics["prompt_tokens_reused"] == cached and metrics["prompt_tokens_received"] == 0
    assert metrics["prompt_tokens_computed"] == len(prompt) - cached
    return answer["choices"][0]["token_ids"], cached


def test_blocks_are_hits_within_the_ttl_and_never_after(tiny_model: str) -> None:
    port, events_port, replay_port = free_port(), free_port(), free_port()
    events, replay = f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{replay_port}"
    args = ["engine", tiny_model, "--port", str(port), "--block-size", str(BLOCK), "--num-blocks", "64"]
    args += ["--kv-retention-ttl", "1", "--kv-events-endpoint", events, "--kv-events-replay-endpoint", replay]
    prompt = list(range(30, 48))  # 18 tokens: 4 full blocks are cacheable
    with running_server(args, port) as url:
        first, cached = generate(url, prompt)
        assert cached == 0
        again, cached = generate(url, prompt)
        assert (again, cached) == (first, 16)
        time.sleep(1.5)  # past the TTL
        late, cached = generate(url, prompt)
        assert (late, cached) == (first, 0)  # recomputed, same answer
        metrics = httpx.get(f"{url}/metrics").text
        assert 'splitserve_prompt_tokens_by_source_total{source="reused"} 16.0' in metrics
        assert 'splitserve_prompt_tokens_by_source_total{source="computed"} 38.0' in metrics  # 18 + 2 + 18
        subscriber = KVEventSubscriber(events, replay)
        try:
            batches = subscriber.replay(0)
        finally:
            subscriber.close()
    removed = {
        h for _s, b in batches for e in b.events if isinstance(e, BlockRemoved) for h in e.block_hashes
    }
    assert set(compute_block_hashes(prompt, BLOCK)[:4]) <= removed


def test_memory_pressure_releases_retained_blocks_expired_first() -> None:
    now = [0.0]
    manager = BlockManager(8, BLOCK, retention_ttl_s=10.0, clock=lambda: now[0])

    def run(request_id: str, tokens: list[int]) -> Request:
        request = Request(generate_request(request_id, tokens), eos_token_ids=frozenset(), block_size=BLOCK)
        assert manager.allocate_slots(request, len(tokens), manager.get_computed_blocks(request))
        request.num_computed_tokens = len(tokens)
        manager.cache_full_blocks(request)
        manager.free_blocks(request)
        return request

    old = run("old", list(range(100, 117)))  # 4 cached blocks, retained until t=10
    now[0] = 5.0
    recent = run("recent", list(range(200, 213)))  # 3 cached blocks, retained until t=15
    now[0] = 12.0  # old expired, recent not
    assert manager.get_computed_blocks(old) == []  # expired: never handed out
    assert len(manager.get_computed_blocks(recent)) == 3
    # pressure: 6 blocks needed, 1 free uncached: the 4 expired go first, then 1 of recent's
    run("pressure", list(range(300, 324)))
    manager.check_integrity([])
    assert len(manager.get_computed_blocks(recent)) == 2  # only 1 of recent's blocks was taken
