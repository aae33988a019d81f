"""P/D end to end over HTTP: `splitserve up` and `splitserve proxy` in front of real
prefill/decode engines, checked against the collocated `splitserve serve`."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from splitserve.protocol.errors import APIError
from splitserve.router.pd_engine_client import PDEngineClient
from splitserve.router.pd_policy import PDPolicy
from splitserve.router.workers import Worker, WorkerPool
from tests.conftest import free_port, running_server, running_servers, wait_until, wire_request
from tests.kv.transport_peer import NEEDS_NIXL

WORDS = "the of and to in is that for it as was with be by on not this are or from at prefill decode".split()
SYSTEM = "You are a helpful assistant. " + " ".join(random.Random(0).choice(WORDS) for _ in range(60))


def words(seed: int, count: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(count))


def chats() -> list[list[dict]]:
    """Concurrent chats: a shared system prompt (partial prefix hits on decode), user turns
    of lengths that are not multiples of the block size, one short enough to skip prefill."""
    out = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": words(i, 5 + 17 * i)}]
        for i in range(5)
    ]
    out.append([{"role": "user", "content": "hi"}])
    return out


def metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def chat_token_ids(base: str, messages: list[list[dict]], max_tokens: int = 8) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(m: list[dict]) -> list[int]:
            body = {"messages": m, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
            response = await client.post(f"{base}/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["token_ids"]

        return list(await asyncio.gather(*(one(m) for m in messages)))


@pytest.fixture(scope="module")
def collocated(tiny_model) -> Iterator[str]:
    port = free_port()
    with running_server(["serve", tiny_model, "--port", str(port), "--num-blocks", "1024"], port) as base:
        yield base


def _up(tiny_model: str, port: int, *extra: str):
    args = [
        "up",
        tiny_model,
        "--port",
        str(port),
        "--num-blocks",
        "512",
        "--min-prefill-tokens",
        "16",
        "--pd-decision",
        "threshold",
        *extra,
    ]
    return running_server(args, port, timeout=180)


def up_log(port: int) -> str:
    return (Path(os.environ.get("TMPDIR", "/tmp")) / f"splitserve-test-{port}.log").read_text()


def started_parts(port: int, timeout_s: float = 30) -> dict[str, int]:
    """The parts `up` printed, by name: their pids. The proxy answers /health a moment
    before `up` has seen every part healthy and printed the table, so wait for it."""
    deadline = time.monotonic() + timeout_s
    while "OpenAI API:" not in up_log(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    found = re.findall(r"^\s+(\S+)\s+http://\S+\s+\(pid (\d+)\)", up_log(port), re.M)
    pids = {name: int(pid) for name, pid in found}
    assert set(pids) == {"render", "prefill-0", "decode-0", "proxy"}
    return pids


def internal_auth(pid: int) -> dict[str, str]:
    """The header a part of `up` wants: the deployment token `up` put in its environment."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    tokens = [e.split(b"=", 1)[1] for e in environ if e.startswith(b"SPLITSERVE_INTERNAL_TOKEN=")]
    assert len(tokens) == 1
    return {"Authorization": f"Bearer {tokens[0].decode()}"}


def wait_gone(pids: list[int], timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{pid}").exists() for pid in pids):
            return True
        time.sleep(0.2)
    return False


def test_up_push_over_shm_streams_through_the_openai_client(tiny_model, collocated):
    port = free_port()
    messages = chats()
    expected = asyncio.run(chat_token_ids(collocated, messages))
    with _up(tiny_model, port, "--transport", "shm", "--mode", "push") as base:
        asyncio.run(chat_token_ids(base, messages[:1]))  # decode now caches the system prompt
        assert asyncio.run(chat_token_ids(base, messages)) == expected
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        reference = openai.OpenAI(base_url=f"{collocated}/v1", api_key="unused")
        for m in messages[1:3]:
            stream = client.chat.completions.create(
                model=None, messages=m, max_tokens=8, temperature=0, stream=True
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            want = reference.chat.completions.create(model=None, messages=m, max_tokens=8, temperature=0)
            assert text == want.choices[0].message.content
        proxy_metrics = httpx.get(f"{base}/metrics").text
        assert metric(proxy_metrics, "splitserve_proxy_requests_total", '{path="pd_push"}') >= 5
        assert metric(proxy_metrics, "splitserve_proxy_requests_total", '{path="decode_only"}') >= 1
        assert metric(proxy_metrics, "splitserve_proxy_prefill_failures_total") == 0
        # bad input gets a clear 4xx and the proxy keeps serving
        assert httpx.post(f"{base}/v1/chat/completions", content=b"{nope").status_code == 400
        bad_n = httpx.post(f"{base}/v1/chat/completions", json={"messages": messages[0], "n": 99})
        assert bad_n.status_code == 400 and bad_n.json()["error"]["param"] == "n"
        assert httpx.post(f"{base}/v1/chat/completions", json={"messages": "x"}).status_code == 400
        assert asyncio.run(chat_token_ids(base, messages[:1])) == expected[:1]
        # SIGTERM to `up` alone stops every part it started
        pids = started_parts(port)
        up_pid = int(Path(f"/proc/{pids['proxy']}/stat").read_text().split(")")[1].split()[1])
        os.kill(up_pid, signal.SIGTERM)
        assert wait_gone(list(pids.values())), "up left parts running"


def thread_affinities(pid: int) -> set[frozenset[int]]:
    """The CPU sets of every thread of a process (a thread inherits its creator's)."""
    return {frozenset(os.sched_getaffinity(int(tid.name))) for tid in Path(f"/proc/{pid}/task").iterdir()}


def environ_value(pid: int, name: str) -> str | None:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    found = [e.split(b"=", 1)[1].decode() for e in entries if e.startswith(name.encode() + b"=")]
    return found[0] if found else None


def test_up_pull_over_tcp_then_starts_a_dead_part_again(tiny_model, collocated):
    port = free_port()
    messages = chats()
    expected = asyncio.run(chat_token_ids(collocated, messages))
    every_cpu = frozenset(os.sched_getaffinity(0))
    first, last = min(every_cpu), max(every_cpu)  # the same CPU on a one-CPU host
    pinned = f"prefill={first},decode-0={last}"
    with _up(tiny_model, port, "--transport", "tcp", "--mode", "pull", "--cpu-affinity", pinned) as base:
        assert asyncio.run(chat_token_ids(base, messages)) == expected
        pids = started_parts(port)
        # --cpu-affinity: each engine's threads (torch's included) on its CPU, one thread
        # for torch per CPU; the parts it does not name on every CPU. Prefill's engine
        # thread and the torch worker it starts may also run on decode's CPU: decode lends
        # it while idle (engine/cpu_lending.py)
        prefill_cpus = thread_affinities(pids["prefill-0"])
        assert frozenset({first}) in prefill_cpus
        assert prefill_cpus <= {frozenset({first}), frozenset({first, last})}
        assert thread_affinities(pids["decode-0"]) == {frozenset({last})}
        assert environ_value(pids["decode-0"], "OMP_NUM_THREADS") == "1"
        assert thread_affinities(pids["render"]) == thread_affinities(pids["proxy"]) == {every_cpu}
        urls = dict(re.findall(r"^\s+(\S+)\s+(http://\S+)", up_log(port), re.M))
        decode_metrics = httpx.get(
            f"{urls['decode-0']}/metrics", headers=internal_auth(pids["decode-0"])
        ).text
        assert metric(decode_metrics, "splitserve_kv_transfers_total", '{outcome="ok",side="decode"}') >= 5
        # the same chat again: decode's prefix cache holds it and reads nothing from prefill;
        # the proxy releases prefill's hold when the request ends, not at its 60 s TTL
        assert asyncio.run(chat_token_ids(base, messages[-1:])) == expected[-1:]
        prefill_auth = internal_auth(pids["prefill-0"])
        deadline = time.monotonic() + 20
        while True:
            prefill_metrics = httpx.get(f"{urls['prefill-0']}/metrics", headers=prefill_auth).text
            assert "splitserve_kv_holds_active" in prefill_metrics
            if metric(prefill_metrics, "splitserve_kv_holds_active") == 0:
                break
            assert time.monotonic() < deadline, "a pull hold outlived its request"
            time.sleep(0.2)
        # a hold nobody reads (the proxy's request ended first: client gone, decode failed)
        # is released on the proxy's word, at once; a second release finds nothing
        held = httpx.post(
            f"{urls['prefill-0']}/inference/v1/generate",
            json={
                "token_ids": list(range(5, 60)),
                "sampling_params": {"max_tokens": 1, "temperature": 0},
                "kv_transfer_params": {"do_remote_decode": True, "transfer_mode": "pull"},
            },
            headers=prefill_auth,
            timeout=60,
        ).json()["kv_transfer_params"]
        hold_id = held["remote_request_id"]
        prefill_metrics = httpx.get(f"{urls['prefill-0']}/metrics", headers=prefill_auth).text
        assert metric(prefill_metrics, "splitserve_kv_holds_active") == 1
        # decode was idle: that 55-token prompt ran on its CPU too (none to lend on one CPU)
        borrowed = metric(prefill_metrics, "splitserve_cpu_borrowed_steps_total")
        assert borrowed >= 1 if first != last else borrowed == 0
        release = f"{urls['prefill-0']}/inference/v1/kv/release_hold"
        assert httpx.post(release, json={"request_id": hold_id}, headers=prefill_auth).json()["released"]
        assert not httpx.post(release, json={"request_id": hold_id}, headers=prefill_auth).json()["released"]
        assert httpx.post(release, json={}, headers=prefill_auth).status_code == 400
        assert httpx.post(release, json={"request_id": hold_id}).status_code == 401  # internal only
        prefill_metrics = httpx.get(f"{urls['prefill-0']}/metrics", headers=prefill_auth).text
        assert metric(prefill_metrics, "splitserve_kv_holds_active") == 0
        unread = '{outcome="released_unread",side="prefill"}'
        assert metric(prefill_metrics, "splitserve_kv_transfers_total", unread) == 1
        os.kill(pids["decode-0"], signal.SIGKILL)
        # up keeps the other parts and starts decode-0 again on its port; the proxy's
        # health checks route to it again once it answers
        deadline = time.monotonic() + 120
        while "decode-0 started again" not in up_log(port):
            assert time.monotonic() < deadline, up_log(port)[-3000:]
            time.sleep(0.2)
        probe = {"messages": messages[-1], "max_tokens": 1}
        while httpx.post(f"{base}/v1/chat/completions", json=probe, timeout=120).status_code != 200:
            assert time.monotonic() < deadline, up_log(port)[-3000:]
            time.sleep(0.2)
        assert asyncio.run(chat_token_ids(base, messages)) == expected
        alive = [pid for name, pid in pids.items() if name != "decode-0"]
        assert all(Path(f"/proc/{pid}").exists() for pid in alive)
        (restarted,) = re.findall(r"decode-0 started again \(pid (\d+)\)", up_log(port))
        assert thread_affinities(int(restarted)) == {frozenset({last})}  # pinned again


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("bogus=0", "no part 'bogus'"),
        ("decode-1=0", "no part 'decode-1'"),  # one decode engine: decode-0 only
        ("decode=4096", "CPU 4096 is not available"),
        ("decode=one", "bad CPU list"),
        ("decode=0,decode=0", "gives 'decode' twice"),
        ("0", "use PART=CPUS"),
    ],
)
def test_up_refuses_a_bad_cpu_affinity_before_starting_anything(tiny_model, value, message):
    proc = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "up", tiny_model, "--cpu-affinity", value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "stopped" not in proc.stderr  # refused before any part was started


async def retry_past_a_dead_decode_worker(
    prefill: str, decode: str, messages: list[dict], render: str
) -> bool:
    """The P/D client (Python API, no health loop) first picks a decode worker that refuses
    connections: the request is retried on the live one and the dead one leaves rotation."""
    dead = f"http://127.0.0.1:{free_port()}"
    client = PDEngineClient(
        WorkerPool([prefill], [dead, decode]), PDPolicy(min_prefill_tokens=16, decision="threshold")
    )
    try:
        async with httpx.AsyncClient() as http:
            rendered = (
                await http.post(f"{render}/v1/chat/completions/render", json={"messages": messages})
            ).json()
        rendered["sampling_params"]["max_tokens"] = 2
        chunks = [chunk async for chunk in client.generate(wire_request(rendered))]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert client.metrics.registry.get_sample_value("splitserve_proxy_retries_total") == 1
        assert [w["healthy"] for w in client.pool.snapshot() if w["role"] == "decode"] == [False, True]
        # health checks also check roles: a prefill engine in the decode pool stays out
        assert await client.check_worker(Worker(decode, "decode"))
        assert not await client.check_worker(Worker(prefill, "decode"))
        assert not await client.check_worker(Worker(render, "decode"))
        return True
    finally:
        await client.close()


def check_kv_bad_input(prefill: str, decode: str) -> None:
    """Wrong KV requests get clear 4xx answers naming the field, or a local recompute; both
    workers keep serving."""
    reserve = f"{decode}/inference/v1/kv/reserve"
    assert httpx.post(f"{prefill}/inference/v1/kv/reserve", json={"request_id": "x"}).status_code == 400
    assert httpx.post(reserve, json={}).json()["error"]["param"] == "request_id"
    assert (
        httpx.post(reserve, json={"request_id": "x", "timeout_s": -1}).json()["error"]["param"] == "timeout_s"
    )
    assert httpx.post(reserve, json={"request_id": "nobody", "timeout_s": 0}).status_code == 404
    assert httpx.post(reserve, content=b"[").status_code == 400
    tokens = list(range(3, 60))
    sampling = {"max_tokens": 2, "temperature": 0}
    bogus = {
        "do_remote_prefill": True,
        "transfer_mode": "pull",
        "remote_block_ids": "nope",
        "remote_host": "127.0.0.1",
        "remote_port": "x",
    }
    response = httpx.post(
        f"{decode}/inference/v1/generate",
        json={"token_ids": tokens, "sampling_params": sampling, "kv_transfer_params": bogus},
        timeout=60,
    )
    # a malformed shape fails that request alone, before the engine loop, naming the field
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "kv_transfer_params.remote_port"
    malformed = {"do_remote_decode": True, "transfer_mode": "push", "remote_block_ids": [1, "two"]}
    response = httpx.post(
        f"{prefill}/inference/v1/generate",
        json={"token_ids": tokens, "sampling_params": sampling, "kv_transfer_params": malformed},
        timeout=60,
    )
    assert response.json()["error"]["param"] == "kv_transfer_params.remote_block_ids"
    push_nowhere = {"do_remote_decode": True, "transfer_mode": "push", "remote_block_ids": [1, 2]}
    response = httpx.post(
        f"{prefill}/inference/v1/generate",
        json={"token_ids": tokens, "sampling_params": sampling, "kv_transfer_params": push_nowhere},
        timeout=60,
    )
    assert response.status_code == 200
    assert "kv_transfer_error" in response.json()["kv_transfer_params"]


@pytest.mark.parametrize("kind", ["tcp", pytest.param("nixl", marks=NEEDS_NIXL)])
def test_killing_prefill_mid_transfer_loses_no_request(tiny_model, collocated, kind):
    render_port, prefill_port, decode_port, proxy_port = (free_port() for _ in range(4))
    engine = ["engine", tiny_model, "--num-blocks", "1024", "--kv-transport", kind, "--kv-timeout", "5"]
    prefill_args = [
        *engine,
        "--role",
        "prefill",
        "--port",
        str(prefill_port),
        "--max-num-batched-tokens",
        "16",
    ]
    decode_args = [*engine, "--role", "decode", "--port", str(decode_port)]
    long_chats = [[{"role": "user", "content": words(100 + i, 1100 + 13 * i)}] for i in range(6)]
    expected = asyncio.run(chat_token_ids(collocated, long_chats, max_tokens=4))
    render_args = ["render", tiny_model, "--port", str(render_port)]
    tiers = [(render_args, render_port), (prefill_args, prefill_port), (decode_args, decode_port)]
    with (
        running_servers(tiers) as (render, prefill, decode),  # started side by side
        running_server(
            ["proxy", "--render", render, "--prefill", prefill, "--decode", decode, "--port", str(proxy_port),
             "--min-prefill-tokens", "16", "--pd-decision", "threshold", "--health-interval", "0.5"],
            proxy_port,
        ) as proxy,
    ):  # fmt: skip
        prefill_pid = httpx.get(f"{prefill}/inference/v1/kv/info").json()["pid"]
        assert asyncio.run(retry_past_a_dead_decode_worker(prefill, decode, long_chats[0], render))
        check_kv_bad_input(prefill, decode)

        async def run() -> list[list[int]]:
            requests = asyncio.ensure_future(chat_token_ids(proxy, long_chats, max_tokens=4))
            async with httpx.AsyncClient() as client:
                for _ in range(2000):
                    text = (await client.get(f"{decode}/metrics")).text
                    if metric(text, "splitserve_kv_transfer_bytes_total", '{direction="received"}') > 0:
                        break
                    await asyncio.sleep(0.005)
            os.kill(prefill_pid, signal.SIGKILL)  # mid-transfer: some KV has landed, most has not
            return await requests

        assert asyncio.run(run()) == expected
        decode_metrics = httpx.get(f"{decode}/metrics").text
        assert metric(decode_metrics, "splitserve_kv_transfer_failures_total", '{side="decode"}') >= 1
        assert metric(decode_metrics, "splitserve_kv_fallbacks_total", '{action="recompute"}') >= 1
        assert metric(decode_metrics, "splitserve_kv_reservations_active") == 0
        proxy_metrics = httpx.get(f"{proxy}/metrics").text
        assert metric(proxy_metrics, "splitserve_proxy_prefill_failures_total") >= 1

        def prefill_health() -> list[bool]:
            workers = httpx.get(f"{proxy}/workers").json()["workers"]
            return [w["healthy"] for w in workers if w["role"] == "prefill"]

        # a health check later (--health-interval 0.5), the dead prefill worker is out of rotation
        assert wait_until(lambda: prefill_health() == [False], 10), prefill_health()
        assert asyncio.run(chat_token_ids(proxy, long_chats[:1], max_tokens=4)) == expected[:1]


def test_failure_policy_fail_answers_a_clear_error(tiny_model):
    """A decode worker with --kv-failure-policy fail ends a request whose KV cannot come;
    the proxy's client turns that into a 502 with the reason, before any output."""
    port = free_port()
    args = ["engine", tiny_model, "--role", "decode", "--port", str(port), "--kv-failure-policy", "fail"]
    with running_server([*args, "--kv-reservation-ttl", "0.5", "--num-blocks", "256"], port) as decode:
        tokens = list(range(3, 90))
        body = {"token_ids": tokens, "sampling_params": {"max_tokens": 3, "temperature": 0}}
        waited = httpx.post(
            f"{decode}/inference/v1/generate",
            json={**body, "kv_transfer_params": {"do_remote_prefill": True}},
        ).json()
        assert waited["choices"][0]["finish_reason"] == "abort" and waited["choices"][0]["token_ids"] == []
        assert "TTL" in waited["kv_transfer_params"]["handoff"]["error"]

        async def through_proxy_client() -> None:
            dead_prefill = f"http://127.0.0.1:{free_port()}"
            client = PDEngineClient(
                WorkerPool([dead_prefill], [decode]), PDPolicy(min_prefill_tokens=16, decision="threshold")
            )
            try:
                with pytest.raises(APIError) as failed:
                    async for _ in client.generate(wire_request({**body, "request_id": "doomed"})):
                        pass
                assert failed.value.status == 502 and "policy is fail" in failed.value.message
            finally:
                await client.close()

        asyncio.run(through_proxy_client())
        metrics = httpx.get(f"{decode}/metrics").text
        assert metric(metrics, "splitserve_kv_fallbacks_total", '{action="fail"}') == 2
        assert metric(metrics, "splitserve_kv_cache_blocks_free") == 256
