"""Block pinning (the issue's attack 6): a decode worker bounds the requests waiting for
remote KV; past its limit a new one gets 429 with `Retry-After`, and is served again
once the reservations are gone, which happens as soon as their clients disconnect. The
proxy bounds each client (address, API key or both) in requests and in KV blocks.
SSRF (attack 5): an engine dials only the KV peers registered with it (`--kv-peers`)."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import free_port, running_server, running_servers, wait_until
from tests.security.test_access import DialCounter

PROMPT = list(range(10, 90))  # 80 tokens: 5 blocks of 16


def _waiting_request(request_id: str) -> dict:
    return {
        "request_id": request_id,
        "token_ids": PROMPT,
        "sampling_params": {"max_tokens": 2, "temperature": 0},
        "kv_transfer_params": {"do_remote_prefill": True},
    }


def _gauge(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"splitserve_kv_{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no gauge {name}")


class WaitingClient:
    """A client whose request waits for remote KV that never comes, until it disconnects
    (a raw socket: closed while the server has not answered yet)."""

    def __init__(self, base: str, request_id: str):
        host, port = base.removeprefix("http://").split(":")
        body = json.dumps({**_waiting_request(request_id), "stream": True}).encode()
        head = (
            f"POST /inference/v1/generate HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.socket = socket.create_connection((host, int(port)), timeout=30)
        self.socket.sendall(head.encode() + body)

    def close(self) -> None:
        self.socket.close()


def test_decode_refuses_reservations_past_its_limit_and_frees_them_when_clients_leave(tiny_model):
    """A request naming a KV peer outside `--kv-peers` is refused (403) and nothing is
    dialled. Past `--kv-max-reservations`, 429 with Retry-After; a client that disconnects while
    its request waits for KV gives its reserved blocks back at once, long before the TTL
    (tcp: the receiver writes every byte itself, so nothing lands after it stops)."""
    port, registered = free_port(), free_port()
    args = ["engine", tiny_model, "--role", "decode", "--port", str(port), "--num-blocks", "64"]
    args += ["--kv-transport", "tcp", "--kv-max-reservations", "2", "--kv-reservation-ttl", "300"]
    args += ["--kv-peers", f"127.0.0.1:{registered}"]
    elsewhere = DialCounter()
    with running_server(args, port) as decode, contextlib.closing(elsewhere):
        # the SSRF: a pull naming a host and port the deployment never registered
        pull = {
            **_waiting_request("ssrf"),
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "transfer_mode": "pull",
                "remote_engine_id": "prefill-x",
                "remote_host": "127.0.0.1",
                "remote_port": elsewhere.port,
                "remote_request_id": "hold",
                "remote_block_ids": [0, 1, 2, 3, 4],
            },
        }
        refused = httpx.post(f"{decode}/inference/v1/generate", json=pull, timeout=60)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "kv_peer_not_registered"
        time.sleep(0.5)  # a dial, had one started, would have reached the listener by now
        assert elsewhere.dials == 0

        pins = [WaitingClient(decode, f"pin-{i}") for i in range(2)]
        try:
            for i in range(2):  # both have reserved their blocks
                reserved = httpx.post(
                    f"{decode}/inference/v1/kv/reserve", json={"request_id": f"pin-{i}", "timeout_s": 30}
                )
                assert reserved.status_code == 200, reserved.text
            assert _gauge(decode, "reserved_blocks") == 10  # 79 positions: 5 blocks each
            refused = httpx.post(
                f"{decode}/inference/v1/generate", json=_waiting_request("third"), timeout=60
            )
            assert refused.status_code == 429, refused.text
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "kv_reservations_full"
            # a request that needs no remote KV is still served at once
            plain = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}
            assert httpx.post(f"{decode}/inference/v1/generate", json=plain, timeout=60).status_code == 200
        finally:
            for pin in pins:
                pin.close()  # the clients leave: their reservations go now, not at the TTL
        assert wait_until(lambda: _gauge(decode, "reservations_active") == 0, 60)
        assert _gauge(decode, "reserved_blocks") == 0
        again = WaitingClient(decode, "third")
        try:
            reserved = httpx.post(
                f"{decode}/inference/v1/kv/reserve", json={"request_id": "third", "timeout_s": 30}
            )
            assert reserved.status_code == 200, reserved.text
        finally:
            again.close()
        assert wait_until(lambda: _gauge(decode, "reserved_blocks") == 0, 60)


def test_the_proxy_passes_the_429_and_its_retry_after_on(tiny_model):
    render_port, prefill_port, decode_port, proxy_port = (free_port() for _ in range(4))
    engine = ["engine", tiny_model, "--num-blocks", "64", "--kv-transport", "shm"]
    prefill_args = [*engine, "--role", "prefill", "--port", str(prefill_port)]
    decode_args = [*engine, "--role", "decode", "--port", str(decode_port), "--kv-max-reservations", "0"]
    render_args = ["render", tiny_model, "--port", str(render_port)]
    tiers = [(render_args, render_port), (prefill_args, prefill_port), (decode_args, decode_port)]
    with (
        running_servers(tiers) as (render, prefill, decode),  # started side by side
        running_server(
            ["proxy", "--render", render, "--prefill", prefill, "--decode", decode, "--port", str(proxy_port),
             "--min-prefill-tokens", "1", "--pd-decision", "threshold"], proxy_port
        ) as proxy,
    ):  # fmt: skip
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
        refused = httpx.post(f"{proxy}/v1/chat/completions", json=body, timeout=60)
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"


TENANT_A, TENANT_B = "sk-tenant-a", "sk-tenant-b"
KV_BUDGET = 8  # blocks per client on `keyed_proxy`; PROMPT takes 5 (80 tokens, blocks of 16)


@pytest.fixture(scope="module")
def keyed_proxy(tiny_model) -> Iterator[str]:
    """A proxy with two API keys (through the environment, never a command line), bounding
    each address and each key to 2 requests in flight and KV_BUDGET blocks."""
    render_port, decode_port, proxy_port = (free_port() for _ in range(3))
    decode_args = ["engine", tiny_model, "--role", "decode", "--port", str(decode_port)]
    decode_args += ["--num-blocks", "320", "--kv-transport", "shm"]
    proxy_args = ["proxy", "--port", str(proxy_port), "--quota-by", "address", "api-key"]
    proxy_args += ["--max-in-flight-per-client", "2", "--max-kv-blocks-per-client", str(KV_BUDGET)]
    keys = {"SPLITSERVE_API_KEY": f"{TENANT_A},{TENANT_B}"}
    render_args = ["render", tiny_model, "--port", str(render_port)]
    with (
        running_servers([(render_args, render_port), (decode_args, decode_port)]) as (render, decode),
        running_server(
            [*proxy_args, "--render", render, "--decode", decode, "--open-health-metrics"],
            proxy_port,
            env=keys,
        ) as proxy,
    ):
        yield proxy


def _client(source: str, key: str) -> httpx.Client:
    transport = httpx.HTTPTransport(local_address=source)
    return httpx.Client(transport=transport, timeout=240, headers={"Authorization": f"Bearer {key}"})


def _complete(base: str, source: str, key: str, prompt: list[int] = PROMPT) -> httpx.Response:
    with _client(source, key) as client:
        return client.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 2})


def _held(base: str, source: str, key: str) -> socket.socket:
    """A request whose body never finishes arriving: in flight until the socket closes."""
    host, port = base.removeprefix("http://").split(":")
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    )
    held = socket.create_connection((host, int(port)), timeout=30, source_address=(source, 0))
    held.sendall(head.encode())
    return held


def _until(send, done, timeout_s: float = 30) -> httpx.Response:
    """`send()` again until its response satisfies `done` (or the time is up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = send()
        if done(response) or time.monotonic() > deadline:
            return response
        time.sleep(0.2)


def _assert_quota_refusal(response: httpx.Response, what: str) -> None:
    assert response.status_code == 429, response.text
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "client_quota_exceeded")
    assert what in error["message"], error["message"]


def test_requests_in_flight_are_bounded_per_api_key_across_addresses(keyed_proxy):
    """--quota-by address api-key: tenant A's two requests from two addresses use its
    key's whole bound, so a third from a fresh address is refused; tenant B is served,
    from that address and from one where A has a request in flight."""
    base = keyed_proxy
    held = [_held(base, "127.0.0.1", TENANT_A), _held(base, "127.0.0.2", TENANT_A)]
    try:
        refused = _until(lambda: _complete(base, "127.0.0.3", TENANT_A), lambda r: r.status_code == 429)
        _assert_quota_refusal(refused, "this API key has 2 requests in flight")
        for source in ("127.0.0.3", "127.0.0.1"):
            served = _complete(base, source, TENANT_B)
            assert served.status_code == 200, served.text
    finally:
        for connection in held:
            connection.close()
    again = _until(lambda: _complete(base, "127.0.0.3", TENANT_A), lambda r: r.status_code != 429)
    assert again.status_code == 200, again.text


def test_kv_blocks_are_bounded_per_client_while_its_requests_run(keyed_proxy):
    """--max-kv-blocks-per-client: while tenant A streams an 80-token prompt (5 of its 8
    blocks), another such prompt from A is refused, from its address and from another
    (the key's budget); tenant B is served; a prompt larger than the whole budget is a
    413; once A's stream ends its blocks are given back."""
    base = keyed_proxy
    body = {"prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    streaming = _client("127.0.0.1", TENANT_A)
    with streaming, streaming.stream("POST", f"{base}/v1/completions", json=body) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # the engine request runs
        for source in ("127.0.0.1", "127.0.0.2"):
            _assert_quota_refusal(_complete(base, source, TENANT_A), "holds 5 of its 8 KV blocks")
        served = _complete(base, "127.0.0.2", TENANT_B)
        assert served.status_code == 200, served.text
        too_large = _complete(base, "127.0.0.2", TENANT_B, list(range(10, 10 + 16 * (KV_BUDGET + 1))))
        assert too_large.status_code == 413, too_large.text
        assert too_large.json()["error"]["code"] == "client_quota_exceeded"
    again = _until(lambda: _complete(base, "127.0.0.1", TENANT_A), lambda r: r.status_code != 429)
    assert again.status_code == 200, again.text
