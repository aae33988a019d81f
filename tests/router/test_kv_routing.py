"""Cache-aware routing over a pool of engines (`splitserve up --prefill 0 --decode 2`):
the proxy indexes the engines' KV events and sends a request to the replica that holds
its token prefix; cache_salt keeps tenants apart in the index."""

from __future__ import annotations

import random
import time

import httpx

from tests.conftest import free_port, running_server
from tests.router.test_pd_proxy import metric

WORDS = "the of and to in is that for it as was with be by on not this are or from at".split()


def text(seed: int, count: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(count))


SYSTEM_A = "You are a travel agent. " + text(1, 80)
SYSTEM_B = "You are a tax advisor. " + text(2, 80)
USER_A, USER_B = "Plan " + text(3, 12), "Explain " + text(4, 12)


def chat(base: str, system: str, user: str, **extra) -> None:
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 2,
        "temperature": 0,
        **extra,
    }
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text


def served(base: str) -> dict[str, int]:
    return {w["url"]: w["served"] for w in httpx.get(f"{base}/workers").json()["workers"]}


def served_by(base: str, send) -> str:
    """The worker that served the one request `send` makes."""
    before = served(base)
    send()
    after = served(base)
    (url,) = [u for u in after if after[u] != before[u]]
    return url


def wait_indexed(base: str, url: str, timeout_s: float = 30) -> None:
    """Until the proxy's index holds blocks of `url` (events arrive asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(f"{base}/workers").json()["kv_index_blocks"].get(url):
            return
        time.sleep(0.1)
    raise AssertionError(f"the proxy never indexed {url}'s blocks")


def test_router_picks_the_replica_holding_the_token_prefix(tiny_model: str) -> None:
    port = free_port()
    args = ["up", tiny_model, "--port", str(port), "--prefill", "0", "--decode", "2", "--num-blocks", "256"]
    with running_server(args, port, timeout=180) as base:
        holder_a = served_by(base, lambda: chat(base, SYSTEM_A, USER_A))
        wait_indexed(base, holder_a)
        holder_b = served_by(base, lambda: chat(base, SYSTEM_B, USER_B))
        assert holder_b != holder_a  # nothing cached for B anywhere: the idle one
        wait_indexed(base, holder_b)
        # the token prefix decides, not the similar user text; several in a row, so that
        # least-loaded rotation would have sent some elsewhere
        for system, user, holder in ((SYSTEM_A, USER_B, holder_a), (SYSTEM_B, USER_A, holder_b)):
            for _ in range(3):
                assert served_by(base, lambda: chat(base, system, user)) == holder  # noqa: B023
        metrics = httpx.get(f"{base}/metrics").text
        hits = metric(metrics, "splitserve_proxy_prefix_hit_blocks_total")
        queried = metric(metrics, "splitserve_proxy_prefix_query_blocks_total")
        assert 0 < hits < queried
        # another tenant's salt changes every block hash: A's cached prefix is no hit for it
        chat(base, SYSTEM_A, USER_A, cache_salt="tenant-2")
        metrics = httpx.get(f"{base}/metrics").text
        assert metric(metrics, "splitserve_proxy_prefix_hit_blocks_total") == hits
        assert metric(metrics, "splitserve_proxy_prefix_query_blocks_total") > queried
