"""Multi-turn reuse is by chained block hash, never by position (vLLM issue #43094): the
Qwen3-like template drops an earlier turn's reasoning, so turn 2's prompt differs from
what the decode worker generated in turn 1 from that point on. Turn 2 through P/D equals
a fresh collocated run; only the leading blocks that match are reused."""

from __future__ import annotations

import httpx

from tests.conftest import free_port, running_servers

BLOCK = 16  # the engines' default block size
SYSTEM = "You answer questions about servers. " + " ".join(f"fact{i}" for i in range(30))


def chat(base: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def test_turn_two_after_dropped_reasoning_equals_a_fresh_collocated_run(tiny_model: str) -> None:
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which server is up?"}]
    up_port, serve_port = free_port(), free_port()
    up_args = [
        "up",
        tiny_model,
        "--port",
        str(up_port),
        "--num-blocks",
        "512",
        "--min-prefill-tokens",
        "16",
        "--pd-decision",
        "threshold",
    ]
    serve_args = ["serve", tiny_model, "--port", str(serve_port)]
    # the fresh collocated server starts beside `up` (and serves nothing before turn 2)
    with running_servers([(up_args, up_port), (serve_args, serve_port)], timeout=180) as (pd, fresh):
        first = chat(pd, turn1, max_tokens=24)
        message = first["choices"][0]["message"]
        # the client sends the answer back with reasoning; the template drops the reasoning
        answer = {
            "role": "assistant",
            "content": message.get("content") or "ok",
            "reasoning_content": message.get("reasoning_content") or "thinking about the servers",
        }
        turn2 = [*turn1, answer, {"role": "user", "content": "And which one is down? " + "why " * 20}]
        second = chat(pd, turn2, max_tokens=12)
        expected = chat(fresh, turn2, max_tokens=12)
    assert second["prompt_token_ids"] == expected["prompt_token_ids"]
    assert second["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
    # what decode held after turn 1: its prompt and what it generated
    held = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
    matching = common_prefix(held, second["prompt_token_ids"])
    assert matching < len(held)  # the template rewrote turn 1: position-based reuse would be wrong
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached <= matching // BLOCK * BLOCK  # leading matching blocks only
