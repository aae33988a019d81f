"""P/D for a hybrid (attention + Mamba2) model through `splitserve up --prefill 1 --decode 1`
and the openai client: greedy chat answers equal `splitserve serve`'s, over shm and tcp,
with the Mamba state handed over whole beside the KV and counted apart from it.

The six-turn chat runs with bidirectional reuse: its short first turn stays on decode
(decode computes it and keeps snapshots of its state), so the second turn's reservation
lends that prefix; prefill declines it (no state travels with a lent prefix) and computes
it, counted as `hybrid_prefix_recompute`. Later turns resume on prefill from its own
snapshots of the earlier prompts (`reused`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import free_port, running_servers, wait_until
from tests.router.test_bidirectional_pd import Up
from tests.router.test_pd_proxy import chat_token_ids, internal_auth, metric, words

UP_FLAGS = ["--num-blocks", "256", "--min-prefill-tokens", "40", "--pd-decision", "threshold"]


@pytest.fixture(scope="module")
def stacks(tiny_model_factory) -> Iterator[tuple[Up, Up, str]]:
    """`up` over shm, `up` over tcp and the collocated `serve`, started side by side."""
    model = tiny_model_factory(arch="nemotron_h")
    shm_port, tcp_port, serve_port = free_port(), free_port(), free_port()
    shm_args = ["up", model, "--port", str(shm_port), "--transport", "shm", *UP_FLAGS]
    tcp_args = ["up", model, "--port", str(tcp_port), "--transport", "tcp", *UP_FLAGS]
    serve_args = ["serve", model, "--port", str(serve_port), "--num-blocks", "256"]
    servers = [(shm_args, shm_port), (tcp_args, tcp_port), (serve_args, serve_port)]
    with running_servers(servers, timeout=180) as (shm_base, tcp_base, serve_base):
        yield Up(shm_base, shm_port), Up(tcp_base, tcp_port), serve_base


def part_metrics(up: Up, part: str) -> str:
    return httpx.get(f"{up.urls[part]}/metrics", headers=internal_auth(up.pids[part]), timeout=10).text


def kv_info(up: Up, part: str) -> dict:
    url = f"{up.urls[part]}/inference/v1/kv/info"
    return httpx.get(url, headers=internal_auth(up.pids[part]), timeout=10).json()


def sent_by_prefill(up: Up, what: str) -> float:
    """Prefill counts a push when its request finishes, which may come after decode's answer."""
    return metric(part_metrics(up, "prefill-0"), f"splitserve_kv_{what}_bytes_total", '{direction="sent"}')


def test_a_six_turn_chat_with_bidirectional_reuse_equals_serve(stacks):
    up, _, serve = stacks
    fresh = openai.OpenAI(base_url=f"{serve}/v1", api_key="unused", max_retries=0)
    messages: list[dict] = [{"role": "user", "content": words(1, 14)}]
    prompt_lengths = []
    for turn in range(6):
        answers = []
        for client in (up.client, fresh):
            response = client.chat.completions.create(
                model=None, messages=messages, max_tokens=8, temperature=0,
                extra_body={"return_token_ids": True},
            )  # fmt: skip
            answers.append(
                (response.choices[0].model_extra["token_ids"], response.choices[0].message.content)
            )
        assert answers[0] == answers[1], turn
        prompt_lengths.append(response.usage.prompt_tokens)
        messages += [
            {"role": "assistant", "content": answers[0][1]},
            {"role": "user", "content": words(10 + turn, 24)},
        ]
    # turn 1 (past one block: decode keeps its state snapshot at 16) alone stays on decode
    assert 16 < prompt_lengths[0] < 40 and prompt_lengths[1] - 16 >= 40, prompt_lengths

    prefill, decode = part_metrics(up, "prefill-0"), part_metrics(up, "decode-0")
    proxy = httpx.get(f"{up.base}/metrics", timeout=10).text
    assert metric(proxy, "splitserve_proxy_requests_total", '{path="decode_only"}') >= 1
    assert metric(proxy, "splitserve_proxy_requests_total", '{path="pd_push"}') >= 5
    # the lent prefix came without a state: recomputed on prefill, never pulled
    assert metric(decode, "splitserve_kv_prefix_blocks_total", '{direction="lent"}') >= 1
    assert metric(prefill, "splitserve_kv_fallbacks_total", '{action="hybrid_prefix_recompute"}') >= 1
    assert metric(prefill, "splitserve_kv_prefix_blocks_total", '{direction="pulled"}') == 0
    # later turns resumed from prefill's own state snapshots of the earlier prompts
    assert metric(prefill, "splitserve_prompt_tokens_by_source_total", '{source="reused"}') >= 16
    received = metric(decode, "splitserve_kv_state_bytes_total", '{direction="received"}')
    assert received > 0 and wait_until(lambda: sent_by_prefill(up, "state") == received, 10)
    assert metric(decode, "splitserve_kv_transfer_failures_total", '{side="decode"}') == 0
    info = kv_info(up, "decode-0")["state_bytes"]
    assert info["received"] == received and received % info["per_request"] == 0


def test_up_over_tcp_equals_serve_and_counts_state_bytes_apart(stacks):
    _, up, serve = stacks
    chats = [[{"role": "user", "content": words(30 + i, 40 + 9 * i)}] for i in range(4)]
    expected = asyncio.run(chat_token_ids(serve, chats))
    assert asyncio.run(chat_token_ids(up.base, chats)) == expected
    proxy = httpx.get(f"{up.base}/metrics", timeout=10).text
    assert metric(proxy, "splitserve_proxy_requests_total", '{path="pd_push"}') == 4
    prefill, decode = kv_info(up, "prefill-0"), kv_info(up, "decode-0")
    assert prefill["transport"] == decode["transport"] == "tcp"
    per_request = decode["state_bytes"]["per_request"]
    assert (
        per_request > 0
        and decode["state_bytes"]["received"] == prefill["state_bytes"]["sent"] == 4 * per_request
    )
    decode_metrics = part_metrics(up, "decode-0")
    kv = metric(decode_metrics, "splitserve_kv_transfer_bytes_total", '{direction="received"}')
    assert kv > 0 and wait_until(lambda: sent_by_prefill(up, "transfer") == kv, 10)
