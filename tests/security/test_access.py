"""Credentials against real processes: the public API key on `serve` and the proxy, the
internal token `up` generates for its parts, loopback binding, and no /docs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.bench.conftest import splitserve_bench
from tests.conftest import free_port, running_server
from tests.router.test_pd_proxy import internal_auth, started_parts, up_log

API_KEY = "sk-test-public-key"
LONG_PROMPT = [{"role": "user", "content": "tell me about the weather tomorrow please " * 4}]
PER_CLIENT = 3  # requests in flight per client address on `exposed_up` (its tests send <= 3)


def _assert_unauthorized(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.json()["error"]["type"] == "authentication_error"
    assert response.headers["www-authenticate"] == "Bearer"


def test_serve_takes_the_api_key_from_the_environment(tiny_model):
    port = free_port()
    args = ["serve", tiny_model, "--port", str(port), "--num-blocks", "256", "--open-health-metrics"]
    with running_server(args, port, env={"SPLITSERVE_API_KEY": API_KEY}) as base:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        _assert_unauthorized(httpx.post(f"{base}/v1/chat/completions", json=body))
        _assert_unauthorized(httpx.get(f"{base}/v1/models"))
        wrong = {"Authorization": "Bearer sk-wrong"}
        _assert_unauthorized(httpx.post(f"{base}/v1/chat/completions", json=body, headers=wrong))
        _assert_unauthorized(httpx.get(f"{base}/v1/models", headers={"Authorization": API_KEY}))
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(f"{base}{path}").status_code == 404
        assert httpx.get(f"{base}/health").status_code == 200  # --open-health-metrics

        client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
        answer = client.chat.completions.create(model=None, messages=body["messages"], max_tokens=2)
        assert answer.choices[0].finish_reason in {"length", "stop"}
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="sk-wrong", max_retries=0).models.list()


class DialCounter:
    """A local listener that counts the connections made to it (an SSRF target)."""

    def __init__(self) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.socket.settimeout(0.1)
        self.port = self.socket.getsockname()[1]
        self.dials = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self.socket.accept()
            except TimeoutError:
                continue
            self.dials += 1
            connection.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.socket.close()


@pytest.fixture(scope="module")
def exposed_up(tiny_model) -> Iterator[tuple[str, dict[str, str]]]:
    """`up --host 0.0.0.0 --api-key KEY`: the proxy's URL and each internal part's URL."""
    port = free_port()
    args = [
        "up",
        tiny_model,
        "--port",
        str(port),
        "--num-blocks",
        "256",
        "--min-prefill-tokens",
        "16",
        "--pd-decision",
        "threshold",
    ]
    args += ["--host", "0.0.0.0", "--api-key", API_KEY, "--open-health-metrics", "--transport", "shm"]
    args += ["--max-in-flight-per-client", str(PER_CLIENT)]
    with running_server(args, port, timeout=180) as base:
        started_parts(port)
        urls = dict(re.findall(r"^\s+(\S+)\s+(http://\S+)\s+\(pid", up_log(port), re.M))
        yield base, urls


def _listening_addresses(port: int) -> set[str]:
    """The local addresses listening on `port` (from /proc/net/tcp, hex little-endian)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def _token_of(pid: int) -> str:
    return internal_auth(pid)["Authorization"].removeprefix("Bearer ")


def test_up_exposes_only_the_proxy_and_it_wants_the_key(exposed_up):
    base, urls = exposed_up
    proxy_port = int(base.rsplit(":", 1)[1])
    assert _listening_addresses(proxy_port) == {"0.0.0.0"}
    for name in ("render", "prefill-0", "decode-0"):
        assert urls[name].startswith("http://127.0.0.1:"), urls
        assert _listening_addresses(int(urls[name].rsplit(":", 1)[1])) == {"127.0.0.1"}

    _assert_unauthorized(httpx.post(f"{base}/v1/chat/completions", json={"messages": LONG_PROMPT}))
    assert httpx.get(f"{base}/docs").status_code == 404
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
    stream = client.chat.completions.create(
        model=None, messages=LONG_PROMPT, max_tokens=4, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    # the prompt went through prefill, a KV transfer and decode: the proxy sent the token
    decode_pid = started_parts(proxy_port)["decode-0"]
    metrics = httpx.get(f"{urls['decode-0']}/metrics", headers=internal_auth(decode_pid))
    assert "splitserve_kv_transfer_bytes" in metrics.text


def test_up_gives_each_part_its_token_through_the_environment_only(exposed_up):
    base, _ = exposed_up
    pids = started_parts(int(base.rsplit(":", 1)[1]))
    tokens = {_token_of(pid) for pid in pids.values()}
    assert len(tokens) == 1
    token = tokens.pop()
    assert len(token) >= 32
    for pid in pids.values():
        assert token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()


def test_internal_parts_refuse_callers_without_the_token(exposed_up):
    base, urls = exposed_up
    token = _token_of(started_parts(int(base.rsplit(":", 1)[1]))["decode-0"])
    target = DialCounter()
    try:
        attack = {  # the file-overwrite and SSRF request, sent straight to prefill
            "token_ids": [1, 2, 3, 4],
            "sampling_params": {"max_tokens": 1},
            "kv_transfer_params": {
                "do_remote_decode": True,
                "transfer_mode": "push",
                "remote_block_ids": [0],
                "remote_engine_id": "evil",
                "remote_host": "127.0.0.1",
                "remote_port": target.port,
                "remote_request_id": "victim",
            },
        }
        for name in ("prefill-0", "decode-0"):
            url = urls[name]
            _assert_unauthorized(httpx.post(f"{url}/inference/v1/generate", json=attack))
            _assert_unauthorized(
                httpx.post(f"{url}/inference/v1/abort_requests", json={"request_ids": ["x"]})
            )
            _assert_unauthorized(httpx.post(f"{url}/inference/v1/kv/reserve", json={"request_id": "x"}))
            _assert_unauthorized(
                httpx.post(f"{url}/inference/v1/kv/transfer_failed", json={"request_id": "x", "error": "e"})
            )
            _assert_unauthorized(httpx.get(f"{url}/inference/v1/kv/info"))
            _assert_unauthorized(httpx.get(f"{url}/health"))
            wrong = {"Authorization": "Bearer " + API_KEY}  # the public key is not the internal one
            _assert_unauthorized(httpx.post(f"{url}/inference/v1/generate", json=attack, headers=wrong))
            assert httpx.get(f"{url}/docs").status_code == 404
            good = {"Authorization": f"Bearer {token}"}
            assert httpx.get(f"{url}/health", headers=good).status_code == 200
            # even with the token, an engine dials only the KV peers `up` registered with it
            refused = httpx.post(f"{url}/inference/v1/generate", json=attack, headers=good)
            assert refused.status_code == 403, refused.text
            assert refused.json()["error"]["code"] == "kv_peer_not_registered"
        render = urls["render"]
        _assert_unauthorized(
            httpx.post(f"{render}/v1/chat/completions/render", json={"messages": LONG_PROMPT})
        )
        _assert_unauthorized(httpx.post(f"{render}/v1/derender/pieces", json={"pieces": []}))
        time.sleep(1.0)
        assert target.dials == 0
    finally:
        target.close()


def test_a_hand_started_part_reads_its_token_from_a_file(tiny_model, tmp_path):
    token_file = tmp_path / "internal-token"
    token_file.write_text("a-deployment-token\n")
    port = free_port()
    command = [sys.executable, "-m", "splitserve.cli", "render", tiny_model, "--port", str(port)]
    command += ["--internal-token-file", str(token_file), "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if k != "SPLITSERVE_INTERNAL_TOKEN"}
    process = subprocess.Popen(command, env=env)
    good = {"Authorization": "Bearer a-deployment-token"}
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # running_server's poll sends no token, so wait here
            assert process.poll() is None and time.monotonic() < deadline
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", headers=good).status_code == 200:
                    break
            time.sleep(0.2)
        _assert_unauthorized(httpx.get(f"{base}/v1/models"))
        _assert_unauthorized(httpx.get(f"{base}/health", headers={"Authorization": "Bearer nope"}))
        assert httpx.get(f"{base}/v1/models", headers=good).status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=15)


def test_an_internal_part_will_not_listen_beyond_loopback_without_a_token(tiny_model):
    command = [sys.executable, "-m", "splitserve.cli", "engine", tiny_model, "--host", "0.0.0.0"]
    env = {k: v for k, v in os.environ.items() if k != "SPLITSERVE_INTERNAL_TOKEN"}
    finished = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert finished.returncode != 0
    assert "SPLITSERVE_INTERNAL_TOKEN" in finished.stderr


def _pd_push_count(base: str) -> float:
    found = re.search(
        r'^splitserve_proxy_requests_total\{path="pd_push"\} (\S+)', httpx.get(f"{base}/metrics").text, re.M
    )
    return float(found.group(1)) if found else 0.0


def test_client_request_ids_are_echoed_never_shared_and_may_be_long(exposed_up):
    base, _ = exposed_up
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
    long_id = "x" * 256  # the documented limit; the proxy's own suffixes must not break P/D
    before = _pd_push_count(base)

    # prompts no decode worker holds yet: a cached prefix would (rightly) skip prefill
    fresh = {
        "shared-id": [{"role": "user", "content": "which request ids may two clients share " * 4}],
        long_id: [{"role": "user", "content": "how long may a client's request id be " * 4}],
    }

    async def one(request_id: str):
        return await client.chat.completions.create(
            model=None,
            messages=fresh[request_id],
            max_tokens=6,
            temperature=0,
            extra_body={"request_id": request_id},
        )

    async def both():  # two clients choose the same ID at the same time
        return await asyncio.gather(one("shared-id"), one("shared-id"), one(long_id))

    first, second, long_one = asyncio.run(both())
    assert first.id == second.id == "shared-id"
    assert first.choices[0].message.content == second.choices[0].message.content
    assert long_one.id == long_id
    assert _pd_push_count(base) == before + 3  # every one went through prefill and a KV push
    too_long = httpx.post(
        f"{base}/v1/chat/completions",
        json={"messages": LONG_PROMPT, "request_id": "x" * 257},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "request_id"


def test_bench_runs_against_the_proxy_with_the_key(exposed_up, tiny_model, tmp_path):
    base, _ = exposed_up
    out = tmp_path / "bench.json"
    args = ["--url", base, "--tokenizer", tiny_model, "--input-len", "24", "--output-len", "4"]
    args += ["--rate", "20", "--num-requests", "3", "--warmup", "0", "--json", str(out), "--quiet"]
    refused = splitserve_bench(*args, timeout=120)
    assert refused.returncode != 0
    finished = splitserve_bench(*args, "--api-key", API_KEY, timeout=120)
    assert finished.returncode == 0, finished.stderr
    (level,) = json.loads(out.read_text())["levels"]
    assert level["summary"]["completed"] == 3
    assert API_KEY not in out.read_text()


def _held_request(base: str) -> socket.socket:
    """A chat request whose body never finishes arriving: in flight until the socket closes."""
    host, port = base.removeprefix("http://").split(":")
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    )
    held = socket.create_connection((host, int(port)), timeout=30)
    held.sendall(head.encode())
    return held


def _post_until(base: str, body: dict, done: Callable[[int], bool], timeout_s: float = 30) -> httpx.Response:
    """POST the chat request again until its status satisfies `done` (or the time is up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.post(
            f"{base}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=60,
        )
        if done(response.status_code) or time.monotonic() > deadline:
            return response
        time.sleep(0.2)


def test_one_client_cannot_take_every_slot_and_others_keep_being_served(exposed_up):
    """`--max-in-flight-per-client`: a client (an address) past its bound gets 429 with
    Retry-After and an OpenAI error body at once; a client at another address is served;
    once the first client's requests end (here: it disconnects) it is served again."""
    base, _ = exposed_up
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    held = [_held_request(base) for _ in range(PER_CLIENT)]
    try:
        refused = _post_until(base, body, lambda status: status == 429)  # the held ones are counted
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "client_quota_exceeded")
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0).chat.completions.create(
                model=None, **body
            )
        other_address = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=60)
        with other_address:
            other = openai.OpenAI(
                base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, http_client=other_address
            )
            answer = other.chat.completions.create(model=None, **body)
            assert answer.choices[0].finish_reason in {"length", "stop"}
    finally:
        for connection in held:
            connection.close()
    again = _post_until(base, body, lambda status: status != 429)  # the disconnected ones stop counting
    assert again.status_code == 200, again.text
