"""`splitserve up --kv-transport nixl` against the collocated `splitserve serve`: the
same tokens, the KV moved by NIXL WRITEs (push) and READs (the bidirectional pull of the
answer decode generated in turn 1)."""

from __future__ import annotations

import asyncio

import httpx
import openai

from tests.conftest import free_port, running_servers
from tests.kv.transport_peer import NEEDS_NIXL
from tests.router.test_bidirectional_pd import Up, fresh_tokens, ids
from tests.router.test_pd_proxy import chat_token_ids, chats, internal_auth, metric

BLOCK = 16


@NEEDS_NIXL
def test_up_over_nixl_equals_serve_and_reuses_the_previous_turn(tiny_model):
    up_port, serve_port = free_port(), free_port()
    up_args = ["up", tiny_model, "--port", str(up_port), "--num-blocks", "512", "--kv-transport", "nixl"]
    up_args += ["--min-prefill-tokens", "16", "--pd-decision", "threshold"]
    serve_args = ["serve", tiny_model, "--port", str(serve_port), "--num-blocks", "1024"]
    with running_servers([(up_args, up_port), (serve_args, serve_port)], timeout=180) as (base, serve):
        messages = chats()
        assert asyncio.run(chat_token_ids(base, messages)) == asyncio.run(chat_token_ids(serve, messages))
        up = Up(base, up_port)
        decode_auth = internal_auth(up.pids["decode-0"])
        info = httpx.get(f"{up.urls['decode-0']}/inference/v1/kv/info", headers=decode_auth).json()
        assert info["transport"] == "nixl"
        decode_metrics = httpx.get(f"{up.urls['decode-0']}/metrics", headers=decode_auth).text
        assert metric(decode_metrics, "splitserve_kv_transfers_total", '{outcome="ok",side="decode"}') >= 5

        # turn 2 = turn 1 + the answer decode generated + a new message: prefill READs the
        # answer's blocks from decode's pool and computes only the rest
        fresh = openai.OpenAI(base_url=f"{serve}/v1", api_key="unused", max_retries=0)
        turn1 = ids(1, 70)
        answer, _, _ = up.complete(turn1, 40)
        turn2 = turn1 + answer + ids(2, 30)
        tokens, cached, counted = up.complete(turn2, 8)
        assert tokens == fresh_tokens(fresh, turn2, 8)
        held_blocks = (len(turn1) + len(answer) - 1) // BLOCK
        assert counted["pulled"] == held_blocks * BLOCK - counted["reused"] > 0
        assert cached == held_blocks * BLOCK
