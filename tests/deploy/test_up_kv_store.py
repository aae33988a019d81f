"""`splitserve up --prefill 1 --decode 1 --kv-store`: the KV store tier as a part of the
local stack. A multi-turn chat whose sessions outgrow the engines' pools answers as
`serve` does, token for token, with the store's hits counted and its blocks in the
proxy's routing index; a store killed mid-run costs only hits (every request answers, the
same), and `up` starts it again."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx

from tests.conftest import free_port, running_servers, wait_until
from tests.router.test_pd_proxy import metric, up_log

TOKEN = "up-kv-store-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SESSIONS = 4
TOPICS = ["tides", "volcanoes", "glaciers", "deserts"]


def chat(base: str, messages: list[dict]) -> dict:
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def store_part(port: int, timeout_s: float = 30) -> tuple[str, int]:
    """The store's URL and pid, from the table `up` prints once every part is healthy."""
    deadline = time.monotonic() + timeout_s
    while "OpenAI API:" not in up_log(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    (found,) = re.findall(r"^\s+kvstore\s+(http://\S+)\s+\(pid (\d+)\)", up_log(port), re.M)
    return found[0], int(found[1])


def test_up_with_a_kv_store_equals_serve_and_survives_the_store(tiny_model):
    up_port, serve_port = free_port(), free_port()
    # 20 blocks of 16 tokens: one session's prompt fits, the four do not
    up_args = ["up", tiny_model, "--port", str(up_port), "--kv-store", "--num-blocks", "20"]
    up_args += ["--kv-store-ram-gb", "0.25", "--pd-decision", "threshold", "--min-prefill-tokens", "16"]
    serve_args = ["serve", tiny_model, "--port", str(serve_port)]
    env = {"SPLITSERVE_INTERNAL_TOKEN": TOKEN}
    with running_servers([(up_args, up_port), (serve_args, serve_port)], timeout=180, env=env) as (pd, ref):
        store_url, store_pid = store_part(up_port)
        histories = [
            [{"role": "system", "content": f"You explain {topic} to students, briefly and kindly. " * 3}]
            for topic in TOPICS
        ]

        def one_round(turn: int) -> list[int]:
            """Every session's next turn, round-robin; the cached tokens of each."""
            cached = []
            for history in histories:
                history.append(
                    {"role": "user", "content": f"Question {turn}: tell me more about part {turn}."}
                )
                answer, expected = chat(pd, history), chat(ref, history)
                assert answer["prompt_token_ids"] == expected["prompt_token_ids"]
                assert answer["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
                cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
                history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            return cached

        for turn in range(3):
            one_round(turn)
        metrics = httpx.get(f"{store_url}/metrics", headers=AUTH).text
        hits = metric(metrics, "splitserve_kv_store_hits_total", '{tier="ram"}')
        assert hits > 0 and metric(metrics, "splitserve_kv_store_puts_total") > 0
        workers = httpx.get(f"{pd}/workers").json()
        assert workers["kv_store_blocks"].get("CPU", 0) > 0  # the router follows the store's events

        os.kill(store_pid, signal.SIGKILL)  # its blocks are gone: the next turns cost hits only
        one_round(3)
        assert wait_until(lambda: "kvstore started again" in up_log(up_port), 30)

        def store_healthy() -> bool:
            try:
                return httpx.get(f"{store_url}/health", headers=AUTH).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(store_healthy, 30)
