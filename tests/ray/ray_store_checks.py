"""The Ray deployment's KV store tier, checked on the running two-node deployment of
`tests/ray/test_ray_deploy.py`: evicted blocks reach the store replica and the router's
index, a prompt no engine holds is answered from the store through the ingress, and a
killed store replica is replaced and followed by the running engines."""

from __future__ import annotations

import random

import httpx

from splitserve.kv_store.wire import BlockKey, StoreClient
from splitserve.protocol.block_hash import compute_block_hashes
from tests.ray.ray_helpers import AUTH, ray, wait_for, workers
from tests.router.test_pd_proxy import metric

STORE_PROMPT_BLOCKS = 60  # 960 tokens: ten such prompts (600 blocks) cycle a 512-block pool


def store_prompt(seed: int) -> list[int]:
    """Token IDs below the tiny model's special ones (2043 and up: vision tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(STORE_PROMPT_BLOCKS * 16)]


def completion_token_ids(base: str, tokens: list[int], headers: dict[str, str]) -> list[int]:
    body = {"prompt": tokens, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    response = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def store_metric(store: dict, name: str, auth: dict[str, str]) -> float:
    return metric(httpx.get(f"{store['url']}/metrics", headers=auth).text, name, '{tier="ram"}')


def check_the_kv_store(base: str, collocated: str, members: list[dict], auth: dict[str, str]) -> None:
    """The KV store replica took a decode engine's evicted blocks (the engine got its
    address before starting, on whichever node), the ingress follows its events, and a
    prompt no engine holds any more is answered from the store, through the ingress, with
    `serve`'s tokens. The blocks are evicted by ten long prompts sent to that decode
    engine itself (not through the router: decode may scale up meanwhile, and which
    replica would hold what is then the router's choice)."""
    (store,) = [m for m in members if m["role"] == "kvstore"]
    decode = next(m for m in members if m["role"] == "decode")
    assert all(m["kv_store"] == store["kv_store"] for m in members if m["role"] in ("prefill", "decode"))
    first, *others = [store_prompt(seed) for seed in range(10)]
    for tokens in (first, *others):
        body = {"token_ids": tokens, "sampling_params": {"max_tokens": 1, "temperature": 0}}
        answer = httpx.post(f"{decode['url']}/inference/v1/generate", json=body, headers=auth, timeout=120)
        assert answer.status_code == 200, answer.text
    host, _, port = store["kv_store"].rpartition(":")
    hashes = compute_block_hashes(first, 16)
    keys = [
        BlockKey(h, hashes[i - 1] if i else None, tuple(first[i * 16 : (i + 1) * 16]))
        for i, h in enumerate(hashes)
    ]
    client = StoreClient(host, int(port), auth["Authorization"].removeprefix("Bearer "), timeout_s=5)
    try:  # offloads are asynchronous
        wait_for(lambda: client.has(keys) == STORE_PROMPT_BLOCKS, what="the evicted prompt in the store")
    finally:
        client.close()
    wait_for(
        lambda: (
            httpx.get(f"{base}/workers", headers=AUTH).json()["kv_store_blocks"].get("CPU", 0)
            >= STORE_PROMPT_BLOCKS
        ),
        what="the store's blocks in the router's index",
    )
    hits = store_metric(store, "splitserve_kv_store_hits_total", auth)
    assert completion_token_ids(base, first, AUTH) == completion_token_ids(collocated, first, {})
    # whichever engines served it loaded the prompt's blocks (all but the last) from the store
    assert store_metric(store, "splitserve_kv_store_hits_total", auth) >= hits + STORE_PROMPT_BLOCKS - 1


def check_a_killed_store_costs_only_hits(base: str, collocated: str, auth: dict[str, str]) -> None:
    """The store replica killed outright: Serve starts another (a new address), the
    running engines follow it without restarting, and requests answer the same."""
    (store,) = [m for m in workers() if m["role"] == "kvstore"]
    engines = {m["url"] for m in workers() if m["role"] in ("prefill", "decode")}
    ray.kill(ray.get_actor(store["replica"], namespace="serve"), no_restart=True)

    def followed() -> bool:
        now = [m for m in workers() if m["role"] == "kvstore"]
        if len(now) != 1 or now[0]["url"] == store["url"]:
            return False
        answers = [httpx.get(f"{url}/inference/v1/kv/store", headers=auth).json() for url in engines]
        return {answer["address"] for answer in answers} == {now[0]["kv_store"]}

    wait_for(followed, what="a new store replica, and the engines pointed at it")
    assert {m["url"] for m in workers() if m["role"] in ("prefill", "decode")} == engines  # none restarted
    tokens = store_prompt(0)
    assert completion_token_ids(base, tokens, AUTH) == completion_token_ids(collocated, tokens, {})
