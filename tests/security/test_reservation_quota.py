"""Block pinning (the issue's attack 6): a decode worker bounds the requests waiting for
remote KV; past its limit a new one gets 429 with `Retry-After`, and is served again
once the reservations are gone."""

from __future__ import annotations

import threading

import httpx

from tests.conftest import free_port, running_server

PROMPT = list(range(10, 90))  # 80 tokens: 5 blocks of 16


def _waiting_request(request_id: str) -> dict:
    return {
        "request_id": request_id,
        "token_ids": PROMPT,
        "sampling_params": {"max_tokens": 2, "temperature": 0},
        "kv_transfer_params": {"do_remote_prefill": True},
    }


def test_decode_refuses_reservations_past_its_limit_with_429(tiny_model):
    port = free_port()
    args = ["engine", tiny_model, "--role", "decode", "--port", str(port), "--num-blocks", "64"]
    args += ["--kv-transport", "shm", "--kv-max-reservations", "2", "--kv-reservation-ttl", "2"]
    with running_server(args, port) as decode:
        answers: dict[str, int] = {}

        def send(request_id: str) -> None:  # nobody ever pushes: each waits out the TTL
            response = httpx.post(
                f"{decode}/inference/v1/generate", json=_waiting_request(request_id), timeout=60
            )
            answers[request_id] = response.status_code

        pinning = [threading.Thread(target=send, args=(f"pin-{i}",)) for i in range(2)]
        for thread in pinning:
            thread.start()
        for i in range(2):  # both have reserved their blocks
            reserved = httpx.post(
                f"{decode}/inference/v1/kv/reserve", json={"request_id": f"pin-{i}", "timeout_s": 30}
            )
            assert reserved.status_code == 200, reserved.text
        refused = httpx.post(f"{decode}/inference/v1/generate", json=_waiting_request("third"), timeout=60)
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "kv_reservations_full"
        # a request that needs no remote KV is still served at once
        plain = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}
        assert httpx.post(f"{decode}/inference/v1/generate", json=plain, timeout=60).status_code == 200
        for thread in pinning:
            thread.join(60)
        assert answers == {"pin-0": 200, "pin-1": 200}  # the TTL passed: decode recomputed
        again = httpx.post(f"{decode}/inference/v1/generate", json=_waiting_request("third"), timeout=60)
        assert again.status_code == 200, again.text


def test_the_proxy_passes_the_429_and_its_retry_after_on(tiny_model):
    render_port, prefill_port, decode_port, proxy_port = (free_port() for _ in range(4))
    engine = ["engine", tiny_model, "--num-blocks", "64", "--kv-transport", "shm"]
    prefill_args = [*engine, "--role", "prefill", "--port", str(prefill_port)]
    decode_args = [*engine, "--role", "decode", "--port", str(decode_port), "--kv-max-reservations", "0"]
    with (
        running_server(["render", tiny_model, "--port", str(render_port)], render_port) as render,
        running_server(prefill_args, prefill_port) as prefill,
        running_server(decode_args, decode_port) as decode,
        running_server(
            ["proxy", "--render", render, "--prefill", prefill, "--decode", decode, "--port", str(proxy_port),
             "--min-prefill-tokens", "1"], proxy_port
        ) as proxy,
    ):  # fmt: skip
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
        refused = httpx.post(f"{proxy}/v1/chat/completions", json=body, timeout=60)
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
