"""Bidirectional P/D through `splitserve up` and the openai client: for turn N+1 the
prefill worker pulls, by chained block hash, the leading blocks the decode worker holds
(turn N's answer included, which prefill never computed) and computes only the rest.

Token-ID prompts (`/v1/completions`) make the held prefix exact: turn 2 = turn 1's prompt
+ the answer decode generated + new tokens. Per request, the prefill worker's Prometheus
`prompt_tokens_by_source` says what it reused, pulled and computed (tests run one request
at a time); `usage.prompt_tokens_details.cached_tokens` is reused + pulled."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from splitserve.router.pd_engine_client import PDEngineClient
from splitserve.router.pd_policy import PDPolicy
from splitserve.router.workers import WorkerPool
from splitserve.runtime.access import INTERNAL_TOKEN_ENV
from tests.conftest import free_port, running_servers, wire_request
from tests.router.test_multiturn_reuse import SYSTEM, common_prefix
from tests.router.test_pd_proxy import internal_auth, metric, started_parts, up_log

BLOCK = 16


def ids(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 1800) for _ in range(count)]


class Up:
    """One `up` (1 prefill, 1 decode) and what its engines count."""

    def __init__(self, base: str, port: int) -> None:
        self.base, self.port = base, port
        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        self.pids = started_parts(port)
        self.urls = dict(re.findall(r"^\s+(\S+)\s+(http://\S+)", up_log(port), re.M))

    def sources(self, part: str = "prefill-0") -> dict[str, float]:
        text = httpx.get(
            f"{self.urls[part]}/metrics", headers=internal_auth(self.pids[part]), timeout=10
        ).text
        names = ("reused", "pulled", "received", "computed")
        found = {
            n: metric(text, "splitserve_prompt_tokens_by_source_total", f'{{source="{n}"}}') for n in names
        }
        found["pulled_blocks"] = metric(text, "splitserve_kv_prefix_blocks_total", '{direction="pulled"}')
        return found

    def complete(
        self, prompt: list[int], max_tokens: int, **extra
    ) -> tuple[list[int], int, dict[str, float]]:
        """(generated token IDs, cached tokens, what prefill counted for this request)."""
        before = self.sources()
        response = self.client.completions.create(
            model=None, prompt=prompt, max_tokens=max_tokens, temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True, **extra},
        )  # fmt: skip
        after = self.sources()
        tokens = response.choices[0].model_extra["token_ids"]
        cached = response.usage.prompt_tokens_details.cached_tokens
        return tokens, cached, {k: after[k] - before[k] for k in after}


@pytest.fixture(scope="module")
def servers(tiny_model: str) -> Iterator[tuple[Up, str]]:
    """The `up` under test and a collocated `serve` for the fresh runs, started side by side."""
    up_port, serve_port = free_port(), free_port()
    up_args = ["up", tiny_model, "--port", str(up_port), "--num-blocks", "512"]
    up_args += ["--min-prefill-tokens", "16", "--pd-decision", "threshold"]
    serve_args = ["serve", tiny_model, "--port", str(serve_port), "--num-blocks", "1024"]
    with running_servers([(up_args, up_port), (serve_args, serve_port)], timeout=180) as (base, serve):
        yield Up(base, up_port), serve


@pytest.fixture(scope="module")
def up(servers: tuple[Up, str]) -> Up:
    return servers[0]


@pytest.fixture(scope="module")
def fresh(servers: tuple[Up, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{servers[1]}/v1", api_key="unused", max_retries=0)


def fresh_tokens(fresh: openai.OpenAI, prompt: list[int], max_tokens: int) -> list[int]:
    response = fresh.completions.create(
        model=None, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    return response.choices[0].model_extra["token_ids"]


def test_an_appended_turn_pulls_the_held_answer_and_computes_only_the_new_message(up, fresh):
    turn1 = ids(1, 70)
    answer, _, first = up.complete(turn1, 40)
    assert first["pulled"] == 0 and first["computed"] == len(turn1)
    turn2 = turn1 + answer + ids(2, 30)
    tokens, cached, counted = up.complete(turn2, 8)
    assert tokens == fresh_tokens(fresh, turn2, 8)
    # decode holds turn 1 and its answer (all but the last token computed): 109 → 6 blocks;
    # prefill holds turn 1's prompt (4 blocks) and pulls the other 2, all answer tokens
    held_blocks = (len(turn1) + len(answer) - 1) // BLOCK
    assert counted["reused"] == len(turn1) // BLOCK * BLOCK
    assert counted["pulled"] == held_blocks * BLOCK - counted["reused"] > 0
    assert counted["pulled_blocks"] == held_blocks - len(turn1) // BLOCK
    assert counted["computed"] == len(turn2) - held_blocks * BLOCK  # the new message, and the tail
    assert cached == held_blocks * BLOCK


def test_an_edited_first_message_reuses_nothing(up, fresh):
    turn1 = ids(3, 60)
    answer, _, _ = up.complete(turn1, 30)
    edited = [turn1[0] + 1, *turn1[1:], *answer, *ids(4, 30)]
    tokens, cached, counted = up.complete(edited, 6)
    assert tokens == fresh_tokens(fresh, edited, 6)
    assert cached == 0 and counted["reused"] == 0 and counted["pulled"] == 0
    assert counted["computed"] == len(edited)


def test_tenants_with_different_cache_salts_never_pull_each_others_blocks(up, fresh):
    turn1 = ids(5, 60)
    answer, _, _ = up.complete(turn1, 30, cache_salt="tenant-a")
    turn2 = turn1 + answer + ids(6, 30)
    tokens, cached, counted = up.complete(turn2, 6, cache_salt="tenant-b")
    assert tokens == fresh_tokens(fresh, turn2, 6)
    assert cached == 0 and counted["pulled"] == 0 and counted["reused"] == 0
    _, cached, counted = up.complete(turn2, 6, cache_salt="tenant-a")  # the owner does reuse
    assert counted["pulled"] > 0 and cached > 0


@pytest.mark.parametrize("edit", ["rewritten tool call", "compacted history"])
def test_an_edited_history_reuses_up_to_the_first_differing_block(up, fresh, edit):
    """A harness that rewrites the tool call the model made (a token inside decode's
    answer) or compacts older turns into a summary: reuse stops at the first block that
    differs, wherever it lies, and the output equals a fresh run."""
    seed = 20 if edit == "rewritten tool call" else 30
    turn1 = ids(seed, 70)
    answer, _, _ = up.complete(turn1, 40)
    if edit == "rewritten tool call":
        first_difference = len(turn1) + 10
        rewritten = [*answer[:10], 1 + answer[10] % 1800, *answer[11:]]
        turn2 = [*turn1, *rewritten, *ids(seed + 1, 30)]
    else:
        first_difference = 40
        summary = [token for token in ids(seed + 2, 12) if token != turn1[40]]
        turn2 = [*turn1[:40], *summary, *ids(seed + 3, 30)]
    tokens, cached, counted = up.complete(turn2, 6)
    assert tokens == fresh_tokens(fresh, turn2, 6)
    held = len(turn1) + len(answer) - 1  # decode computed all but the answer's last token
    matching_blocks = min(first_difference, held) // BLOCK
    assert counted["reused"] + counted["pulled"] == matching_blocks * BLOCK == cached
    assert counted["computed"] == len(turn2) - matching_blocks * BLOCK


def test_dropped_reasoning_pulls_only_blocks_that_match_and_equals_a_fresh_run(up, fresh):
    """vLLM #43094: the template drops turn 1's reasoning, so what decode generated differs
    from turn 2's prompt from some point on; reuse stops at the first differing block."""
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which server is up?"}]
    first = up.client.chat.completions.create(
        model=None, messages=turn1, max_tokens=24, temperature=0, extra_body={"return_token_ids": True}
    )
    message = first.choices[0].message
    answer = {
        "role": "assistant",
        "content": message.content or "ok",
        "reasoning_content": getattr(message, "reasoning_content", None) or "thinking about the servers",
    }
    turn2 = [*turn1, answer, {"role": "user", "content": "And which one is down? " + "why " * 20}]
    before = up.sources()
    second = up.client.chat.completions.create(
        model=None, messages=turn2, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    counted = {k: v - before[k] for k, v in up.sources().items()}
    expected = fresh.chat.completions.create(
        model=None, messages=turn2, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    assert second.model_extra["prompt_token_ids"] == expected.model_extra["prompt_token_ids"]
    assert second.choices[0].model_extra["token_ids"] == expected.choices[0].model_extra["token_ids"]
    held = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
    prompt2 = second.model_extra["prompt_token_ids"]
    matching = common_prefix(held, prompt2)
    assert matching < len(held)  # position-based reuse would have loaded KV of other tokens
    assert counted["reused"] + counted["pulled"] <= matching // BLOCK * BLOCK  # nothing that differs
    assert counted["computed"] == len(prompt2) - counted["reused"] - counted["pulled"]
    assert second.usage.prompt_tokens_details.cached_tokens == counted["reused"] + counted["pulled"]


def test_conversation_id_is_accepted_and_never_reaches_an_engine(up, fresh):
    messages = [{"role": "user", "content": "hello there " * 12}]
    for client in (up.client, fresh):
        for _ in range(2):
            reply = client.chat.completions.create(
                model=None,
                messages=messages,
                max_tokens=3,
                temperature=0,
                extra_body={"conversation_id": "conv-7"},
            )
            assert reply.choices[0].finish_reason == "length"
    # an engine refuses fields it does not know: had the proxy forwarded it, the calls above failed
    response = httpx.post(
        f"{up.urls['decode-0']}/inference/v1/generate",
        json={"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 1}, "conversation_id": "conv-7"},
        headers=internal_auth(up.pids["decode-0"]),
        timeout=30,
    )
    assert response.status_code == 400 and "conversation_id" in response.text
    bad = httpx.post(
        f"{up.base}/v1/chat/completions", json={"messages": messages, "conversation_id": ""}, timeout=30
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("prefix_block_hashes", ["not hex"]), ("prefix_block_ids", [1, "2"]), ("prefix_lend_id", 7)],
)
def test_a_malformed_prefix_offer_is_a_400_naming_it(up, field, value):
    kv = {"do_remote_decode": True, "transfer_mode": "push", field: value}
    body = {"token_ids": list(range(40, 80)), "sampling_params": {"max_tokens": 1}, "kv_transfer_params": kv}
    response = httpx.post(
        f"{up.urls['prefill-0']}/inference/v1/generate",
        json=body,
        headers=internal_auth(up.pids["prefill-0"]),
        timeout=30,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == f"kv_transfer_params.{field}"


def test_the_proxys_final_chunk_reports_where_the_prompt_came_from(up, monkeypatch):
    """PDEngineClient (the proxy's engine client) against up's engines: decode's final chunk
    carries prefill's prompt sources in kv_transfer_params.prefill, and the engines' own
    metrics; the conversation hint is remembered and never sent."""
    token = internal_auth(up.pids["prefill-0"])["Authorization"].removeprefix("Bearer ")
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, token)
    turn1 = ids(9, 50)

    async def run() -> tuple[dict, PDEngineClient]:
        client = PDEngineClient(
            WorkerPool([up.urls["prefill-0"]], [up.urls["decode-0"]]),
            PDPolicy(min_prefill_tokens=16, decision="threshold"),
        )
        try:

            async def generate(prompt: list[int], max_tokens: int) -> list[dict]:
                sampling = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
                body = {"token_ids": prompt, "sampling_params": sampling, "conversation_id": "conv-9"}
                return [chunk async for chunk in client.generate(wire_request(body))]

            answer = [
                t for chunk in await generate(turn1, 40) for c in chunk["choices"] for t in c["token_ids"]
            ]
            return (await generate(turn1 + answer + ids(10, 30), 4))[-1], client
        finally:
            await client.close()

    final, client = asyncio.run(run())
    sources = final["kv_transfer_params"]["prefill"]["prompt_sources"]
    assert sources["reused_tokens"] == 48 and sources["pulled_blocks"] == 2 and sources["pulled_tokens"] == 32
    # turn 2: 50 + 40 + 30 tokens; decode held 89 computed (5 blocks), prefill turn 1's 3
    assert sources["reuse_stopped_block"] == 5 and sources["recomputed_tokens"] == 120 - 80
    assert final["metrics"]["prompt_tokens_reused"] == 80  # decode's own cache
    assert final["usage"]["prompt_tokens_details"]["cached_tokens"] == 80  # prefill's reused + pulled
    assert client.conversations.worker_of("conv-9") == up.urls["decode-0"]


def test_a_push_target_the_prefill_worker_cannot_take_is_a_clear_4xx(up):
    """`POST /inference/v1/kv/push_target` (prefill): bad input is a 4xx naming it, a peer
    outside the deployment is refused before anything is dialled, decode has no such
    endpoint's role, and cancelling a request nobody waits for says so."""
    url = f"{up.urls['prefill-0']}/inference/v1/kv/push_target"
    headers = internal_auth(up.pids["prefill-0"])

    def post(body: dict, target: str = url) -> httpx.Response:
        return httpx.post(target, json=body, headers=headers, timeout=10)

    assert post({"kv_transfer_params": {}}).status_code == 400  # no request_id
    bad = post({"request_id": "r", "kv_transfer_params": "here"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_transfer_params"
    bad = post({"request_id": "r", "kv_transfer_params": {"remote_block_ids": "1,2"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_transfer_params.remote_block_ids"
    stranger = {
        "remote_engine_id": "x",
        "remote_host": "127.0.0.1",
        "remote_port": 9,
        "remote_block_ids": [1],
    }
    refused = post({"request_id": "r", "kv_transfer_params": stranger})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "kv_peer_not_registered"
    cancelled = post({"request_id": "nobody-waits"})
    assert cancelled.status_code == 200 and cancelled.json() == {
        "request_id": "nobody-waits",
        "status": "cancelled",
        "cancelled": False,
    }
    decode = f"{up.urls['decode-0']}/inference/v1/kv/push_target"
    wrong_role = httpx.post(
        decode, json={"request_id": "r"}, headers=internal_auth(up.pids["decode-0"]), timeout=10
    )
    assert wrong_role.status_code == 400


def test_a_restarted_decode_worker_means_recomputing_correctly(up, fresh):
    """Last in the module: it kills decode-0, which `up` starts again empty."""
    turn1 = ids(7, 60)
    answer, _, _ = up.complete(turn1, 30)
    os.kill(up.pids["decode-0"], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while "decode-0 started again" not in up_log(up.port):
        assert time.monotonic() < deadline, up_log(up.port)[-3000:]
        time.sleep(0.2)
    probe = {"prompt": [5, 6, 7], "max_tokens": 1}
    while httpx.post(f"{up.base}/v1/completions", json=probe, timeout=60).status_code != 200:
        assert time.monotonic() < deadline, up_log(up.port)[-3000:]
        time.sleep(0.2)
    turn2 = turn1 + answer + ids(8, 30)
    tokens, cached, counted = up.complete(turn2, 6)
    assert tokens == fresh_tokens(fresh, turn2, 6)
    assert counted["pulled"] == 0  # the new decode worker holds nothing to lend
    assert counted["reused"] == len(turn1) // BLOCK * BLOCK  # prefill's own cache still counts
    assert counted["computed"] == len(turn2) - counted["reused"] and cached == counted["reused"]
