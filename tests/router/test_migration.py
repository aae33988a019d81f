"""One dead or stalled part loses nothing, against real processes: `up` with spare
capacity (2 render replicas, 1 prefill, 2 decode workers). While streams run: SIGSTOP the
decode worker serving them (alive, socket open, silent: the proxy's stall probe finds it
and the streams migrate), then SIGKILL it (the streams migrate), a render replica
(derender calls retry on the other) and the prefill worker (decode keeps the streams; new
prompts fall back to decode). Every stream completes, equal to the undisturbed greedy
output (a seeded sampled stream: equal to its undisturbed run); `up` starts each dead
part again and keeps serving. A slow but healthy worker (probed, answers) keeps its
streams."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import httpx
import pytest

from tests.conftest import free_port, running_server
from tests.router.test_pd_proxy import metric, up_log

STREAMS = 2
# Long enough that the engine is still generating when the client has seen some output.
GREEDY = {"prompt": "the migration", "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
SEEDED = {**GREEDY, "temperature": 1.0, "top_p": 0.95, "seed": 4242}
TOKEN = "migration-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}  # to ask a decode part for its stats


class Stream(threading.Thread):
    """One streamed completion: its text pieces as they arrive and its finish reason."""

    def __init__(self, base: str, body: dict | None = None) -> None:
        super().__init__()
        self.base = base
        self.body = body or GREEDY
        self.pieces: list[str] = []
        self.token_ids: list[int] = []  # with return_token_ids
        self.usage: dict | None = None  # with stream_options.include_usage
        self.finish_reason: str | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.base + "/v1/completions", json=self.body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if "choices" not in event:
                            self.error = line
                            return
                        self.usage = event.get("usage") or self.usage
                        for choice in event["choices"]:
                            self.pieces.append(choice["text"])
                            self.token_ids += choice.get("token_ids") or []
                            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except httpx.HTTPError as exc:
            self.error = repr(exc)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class Stack(NamedTuple):
    base: str
    port: int
    urls: dict[str, str]  # by part name
    expected: str  # the undisturbed greedy text of a Stream

    def pid(self, name: str) -> int:
        """The part's process now: the last one `up` started under that name."""
        log = up_log(self.port)
        started = re.findall(rf"^\s+{name}\s+http://\S+\s+\(pid (\d+)\)", log, re.M)
        started += re.findall(rf"{name} started again \(pid (\d+)\)", log)
        return int(started[-1])


@pytest.fixture(scope="module")
def stack(tiny_model) -> Iterator[Stack]:
    port = free_port()
    args = ["up", tiny_model, "--port", str(port), "--decode", "2", "--render", "2", "--num-blocks", "512"]
    # no liveness kills: the SIGSTOPped worker stays stopped until the test resumes it
    args += ["--min-prefill-tokens", "2", "--pd-decision", "threshold", "--stall-timeout", "1"]
    args += ["--liveness-timeout", "0"]
    with running_server(args, port, timeout=180, env={"SPLITSERVE_INTERNAL_TOKEN": TOKEN}) as base:
        while "OpenAI API:" not in up_log(port):
            time.sleep(0.1)
        found = re.findall(r"^\s+(\S+)\s+(http://\S+)\s+\(pid \d+\)", up_log(port), re.M)
        reference = Stream(base)
        reference.run()
        assert reference.finish_reason == "length", reference.error
        yield Stack(base, port, dict(found), reference.text)


def streams_survive(base: str, expected: str, fault: Callable[[], str], body: dict | None = None) -> str:
    """Run streams, call `fault` once each has some output; the name of the part hit."""
    streams = [Stream(base, body) for _ in range(STREAMS)]
    for stream in streams:
        stream.start()
    while not all(stream.pieces or not stream.is_alive() for stream in streams):
        time.sleep(0.01)
    victim = fault()
    for stream in streams:
        stream.join()
    for stream in streams:
        assert stream.error is None
        assert stream.finish_reason == "length"
        assert stream.text == expected
    return victim


def resumed_prompt_tokens(base: str) -> dict[str, float]:
    """The proxy's count of resumed streams' prompt tokens, by where their KV came from."""
    text = httpx.get(f"{base}/metrics").text
    name = "splitserve_proxy_resumed_prompt_tokens_total"
    return {s: metric(text, name, f'{{source="{s}"}}') for s in ("reused", "pulled", "computed")}


def busy_decode(stack: Stack) -> str:
    """A decode worker with requests in flight (one is, while the streams run)."""
    for _ in range(200):
        for name, url in stack.urls.items():
            if name.startswith("decode"):
                stats = httpx.get(f"{url}/inference/v1/stats", headers=AUTH, timeout=10).json()
                if stats["num_running"] + stats["num_waiting"] > 0:
                    return name
    raise AssertionError("no decode worker is running the streams")


def signal_busy_decode(stack: Stack, signum: int, hit: list[str]) -> Callable[[], str]:
    def fault() -> str:
        name = busy_decode(stack)
        os.kill(stack.pid(name), signum)
        hit.append(name)
        return name

    return fault


def wait_all_healthy(base: str) -> None:
    """Until the proxy has every worker in rotation."""
    deadline = time.monotonic() + 60
    while not all(w["healthy"] for w in httpx.get(f"{base}/workers").json()["workers"]):
        assert time.monotonic() < deadline, httpx.get(f"{base}/workers").text
        time.sleep(0.2)


def test_sigstop_of_the_busy_decode_worker_migrates_its_streams(stack: Stack):
    stopped: list[str] = []
    try:
        streams_survive(stack.base, stack.expected, signal_busy_decode(stack, signal.SIGSTOP, stopped))
        metrics = httpx.get(f"{stack.base}/metrics").text
        assert metric(metrics, "splitserve_proxy_decode_stalls_total") >= 1
        # new requests go to the other decode worker while this one is stopped
        during = Stream(stack.base)
        during.run()
        assert during.text == stack.expected
    finally:
        for name in stopped:
            os.kill(stack.pid(name), signal.SIGCONT)
    # the resumed worker passes a health check again and the stack serves on both
    wait_all_healthy(stack.base)
    again = [Stream(stack.base) for _ in range(STREAMS)]
    for stream in again:
        stream.start()
    for stream in again:
        stream.join()
        assert stream.text == stack.expected


def test_a_slow_but_healthy_decode_worker_keeps_its_streams(stack: Stack):
    """A proxy whose stall timeout is shorter than any gap between tokens probes the
    decode workers all the time; they answer, so nothing migrates."""
    port = free_port()
    urls = stack.urls
    args = ["proxy", "--port", str(port), "--stall-timeout", "0.001"]
    args += ["--render", *[u for n, u in urls.items() if n.startswith("render")]]
    args += ["--prefill", *[u for n, u in urls.items() if n.startswith("prefill")]]
    args += ["--decode", *[u for n, u in urls.items() if n.startswith("decode")]]
    with running_server(args, port, env={"SPLITSERVE_INTERNAL_TOKEN": TOKEN}) as base:
        streams_survive(base, stack.expected, lambda: "nothing")
        metrics = httpx.get(f"{base}/metrics").text
    assert metric(metrics, "splitserve_proxy_decode_stall_probes_total") >= 1
    assert metric(metrics, "splitserve_proxy_decode_stalls_total") == 0
    assert metric(metrics, "splitserve_proxy_retries_total") == 0


def test_sigkill_of_any_part_mid_stream_loses_nothing(stack: Stack):
    def kill(name: str) -> Callable[[], str]:
        def killer() -> str:
            os.kill(stack.pid(name), signal.SIGKILL)
            return name

        return killer

    victims = [
        streams_survive(stack.base, stack.expected, signal_busy_decode(stack, signal.SIGKILL, [])),
        streams_survive(stack.base, stack.expected, kill("render-0")),
        streams_survive(stack.base, stack.expected, kill("prefill-0")),
    ]
    assert metric(httpx.get(f"{stack.base}/metrics").text, "splitserve_proxy_retries_total") >= 1

    # up starts each dead part again; the stack still serves
    deadline = time.monotonic() + 120
    while not all(f"{victim} started again" in up_log(stack.port) for victim in victims):
        assert time.monotonic() < deadline, up_log(stack.port)[-3000:]
        time.sleep(0.2)
    again = Stream(stack.base)
    again.run()
    assert again.text == stack.expected


def test_a_seeded_request_migrated_mid_stream_samples_what_an_undisturbed_run_does(stack: Stack):
    """Its draws follow (seed, output position): resumed after k tokens on another decode
    worker, it continues with the undisturbed run's token k."""
    wait_all_healthy(stack.base)
    reference = Stream(stack.base, SEEDED)
    reference.run()
    assert reference.finish_reason == "length", reference.error
    assert reference.text != stack.expected  # sampled, not greedy
    streams_survive(stack.base, reference.text, signal_busy_decode(stack, signal.SIGKILL, []), SEEDED)


def test_a_stream_resumed_after_its_decode_worker_dies_computes_only_the_tail(stack: Stack):
    """The prefill worker still holds the prompt's blocks (its prefix cache): the resumed
    request (prompt + tokens streamed) has it compute only the last partial block and the
    streamed tokens, and push the whole prompt's KV to the new decode worker. The stream's
    prompt is new to every engine, and its undisturbed run comes afterwards."""
    wait_all_healthy(stack.base)
    prompt = random.Random(21).choices(range(300, 1800), k=200)
    body = {**GREEDY, "prompt": prompt, "return_token_ids": True, "stream_options": {"include_usage": True}}
    before = resumed_prompt_tokens(stack.base)
    resumed = Stream(stack.base, body)
    resumed.start()
    while not resumed.pieces and resumed.is_alive():
        time.sleep(0.01)
    signal_busy_decode(stack, signal.SIGKILL, [])()
    resumed.join()
    assert resumed.error is None and resumed.finish_reason == "length"
    counted = {k: v - before[k] for k, v in resumed_prompt_tokens(stack.base).items()}
    kept = len(prompt) // 16 * 16  # the prompt's full blocks, in prefill's prefix cache
    assert counted["reused"] == kept and counted["pulled"] == 0
    # computed: the prompt's last partial block and the tokens streamed before the kill
    assert len(prompt) - kept < counted["computed"] <= len(prompt) - kept + len(resumed.token_ids)
    assert resumed.usage is not None and resumed.usage["prompt_tokens"] == len(prompt)
    assert resumed.usage["prompt_tokens_details"]["cached_tokens"] == kept

    undisturbed = Stream(stack.base, body)
    undisturbed.run()
    assert resumed.token_ids == undisturbed.token_ids and len(resumed.token_ids) == GREEDY["max_tokens"]


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_stall_timeout_that_is_not_positive_is_refused_at_start(value: str):
    args = ["proxy", "--render", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    proc = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", *args, "--stall-timeout", value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "stall_timeout" in proc.stderr
