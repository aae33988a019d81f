"""`splitserve engine --kv-store` and `splitserve serve --kv-store` against a `splitserve
kvstore` process: a session evicted from the small pool comes back from the store, the
same greedy tokens as an engine without it, and both /metrics count it."""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys

import httpx
import pytest

from splitserve.engine.api import cli as engine_cli
from splitserve.engine.api.kv_store_setup import make_kv_store_client
from splitserve.engine.llm import LLM
from splitserve.kv_store.wire import BlockKey, StoreClient
from splitserve.protocol.block_hash import compute_block_hashes
from splitserve.protocol.sampling_params import SamplingParams
from tests.conftest import free_port, running_servers, wait_until

BLOCK = 16
NUM_BLOCKS = 12
MAX_TOKENS = 6


def prompt(seed: int, length: int = 90) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 2000) for _ in range(length)]


SESSION_A = prompt(11)
OTHERS = [prompt(seed) for seed in range(12, 15)]


def store_keys(tokens: list[int]) -> list[BlockKey]:
    hashes = compute_block_hashes(tokens, BLOCK)
    return [
        BlockKey(h, hashes[i - 1] if i else None, tuple(tokens[i * BLOCK : (i + 1) * BLOCK]))
        for i, h in enumerate(hashes)
    ]


def metric_values(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


@pytest.fixture(scope="module")
def expected(tiny_model):
    llm = LLM(tiny_model, num_blocks=NUM_BLOCKS, block_size=BLOCK)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [llm.generate([p], greedy)[0].token_ids for p in [SESSION_A, *OTHERS]]


def open_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "SPLITSERVE_INTERNAL_TOKEN"}


def store_and(tiny_model: str, command: str) -> tuple[list, int, int]:
    """The servers to start: a store, and `command` (engine or serve) pointed at it."""
    store_http, store_kv, port = free_port(), free_port(), free_port()
    # open loopback parts (no token: running_servers' health checks send none); the store's
    # authentication is test_store.py's
    store = ["kvstore", "--port", str(store_http), "--kv-port", str(store_kv), "--kv-store-ram-gb", "0.05"]
    engine = [command, tiny_model, "--port", str(port), "--block-size", str(BLOCK)]
    engine += ["--num-blocks", str(NUM_BLOCKS), "--kv-store", f"127.0.0.1:{store_kv}"]
    return [(store, store_http), (engine, port)], store_kv, store_http


def wait_offloaded(store_kv: int, tokens: list[int]) -> None:
    """Until the store holds every full block of `tokens` (offloads are asynchronous)."""
    client = StoreClient("127.0.0.1", store_kv, None, timeout_s=5)
    try:
        keys = store_keys(tokens)
        assert wait_until(lambda: client.has(keys) == len(keys)), "the blocks never reached the store"
    finally:
        client.close()


def test_engine_with_a_store(tiny_model, expected):
    servers, store_kv, _ = store_and(tiny_model, "engine")
    with running_servers(servers, env=open_env()) as (store, url):

        def generate(tokens: list[int]) -> dict:
            body = {
                "token_ids": tokens,
                "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
            }
            response = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()

        answers = [generate(p) for p in [SESSION_A, *OTHERS]]
        assert [a["choices"][0]["token_ids"] for a in answers] == expected
        wait_offloaded(store_kv, SESSION_A)
        again = generate(SESSION_A)
        assert again["choices"][0]["token_ids"] == expected[0]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
        assert again["metrics"]["prompt_tokens_computed"] == len(SESSION_A) - 80
        engine_metrics = metric_values(httpx.get(f"{url}/metrics").text)
        store_metrics = metric_values(httpx.get(f"{store}/metrics").text)
    assert engine_metrics["splitserve_kv_store_client_loaded_blocks_total"] == 5
    assert engine_metrics['splitserve_kv_store_client_loaded_blocks_by_tier_total{tier="ram"}'] == 5
    assert engine_metrics["splitserve_kv_store_client_offloaded_blocks_total"] >= 5
    assert store_metrics['splitserve_kv_store_hits_total{tier="ram"}'] == 5
    assert store_metrics["splitserve_kv_store_refused_total"] == 0


def test_serve_with_a_store(tiny_model, expected):
    servers, store_kv, _ = store_and(tiny_model, "serve")
    with running_servers(servers, env=open_env()) as (_, url):
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]

        def complete(tokens: list[int]) -> dict:
            body = {"model": model, "prompt": tokens, "max_tokens": MAX_TOKENS, "temperature": 0}
            body |= {"ignore_eos": True, "return_token_ids": True}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()

        answers = [complete(p) for p in [SESSION_A, *OTHERS]]
        wait_offloaded(store_kv, SESSION_A)
        again = complete(SESSION_A)
    assert [a["choices"][0]["token_ids"] for a in answers] == expected
    assert again["choices"][0]["token_ids"] == expected[0]
    assert answers[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 80


def test_kv_store_flag_errors_are_clear(tiny_model):
    parser = argparse.ArgumentParser()
    engine_cli.add_arguments(parser)
    cases = [
        (["--kv-store", "nowhere"], "HOST:PORT"),
        (["--role", "encoder", "--kv-store", "127.0.0.1:9"], "not encoder"),
        (["--no-prefix-caching", "--kv-store", "127.0.0.1:9"], "prefix cache"),
        (["--kv-store", "127.0.0.1:9", "--kv-store-offload-queue", "0"], "offload-queue"),
    ]
    for flags, message in cases:
        args = parser.parse_args([tiny_model, "--device", "cpu", *flags])
        with pytest.raises(ValueError, match=message):
            make_kv_store_client(args, engine_cli.engine_config(args, tiny_model), None)
    # and the command says so, before loading the model
    finished = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "serve", tiny_model, "--kv-store", "nowhere"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert finished.returncode == 2 and "--kv-store needs HOST:PORT" in finished.stderr


def test_an_engine_follows_its_store_to_a_new_address(tiny_model, expected):
    """A deployment whose store came back elsewhere (Ray) re-points the running engine:
    `POST /inference/v1/kv/store` (no restart, no cool-down left from the old address)."""
    servers, store_kv, _ = store_and(tiny_model, "engine")
    (store, store_http), (engine, port) = servers
    gone = f"127.0.0.1:{free_port()}"  # the old store's address: nothing answers there
    engine[engine.index("--kv-store") + 1] = gone
    with running_servers([(store, store_http), (engine, port)], env=open_env()) as (_, url):

        def generate(tokens: list[int]) -> dict:
            body = {
                "token_ids": tokens,
                "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
            }
            response = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()

        assert generate(SESSION_A)["choices"][0]["token_ids"] == expected[0]  # its lookup fails
        assert httpx.get(f"{url}/inference/v1/kv/store").json() == {"address": gone}
        for bad in ({"address": "nowhere"}, {"address": 7}, ["127.0.0.1:1"]):
            answer = httpx.post(f"{url}/inference/v1/kv/store", json=bad)
            assert answer.status_code == 400 and "error" in answer.json(), answer.text
        moved = httpx.post(f"{url}/inference/v1/kv/store", json={"address": f"127.0.0.1:{store_kv}"})
        assert moved.status_code == 200 and moved.json() == {"address": f"127.0.0.1:{store_kv}"}
        # the others evict SESSION_A's blocks: offloaded to the new address at once
        assert [generate(p)["choices"][0]["token_ids"] for p in OTHERS] == expected[1:]
        wait_offloaded(store_kv, SESSION_A)
        again = generate(SESSION_A)
        assert again["choices"][0]["token_ids"] == expected[0]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
        engine_metrics = metric_values(httpx.get(f"{url}/metrics").text)
    assert engine_metrics["splitserve_kv_store_client_lookup_errors_total"] == 1
    assert engine_metrics["splitserve_kv_store_client_loaded_blocks_total"] == 5
