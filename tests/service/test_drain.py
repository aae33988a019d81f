"""SIGTERM drains, against real processes: `up` (the whole stack) and `serve` (one part).
New work gets a 503 with Retry-After and /health goes unready, the streams in flight all
finish with the tokens an undisturbed run gives, then the process exits by itself."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

STREAMS = 3
# long enough that the streams outlast the checks made during the drain (a health poll and
# one refused request: well under a second) on a fast engine: seconds of runway
BODY = {"prompt": "the drain", "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}


@contextlib.contextmanager
def started(args: list[str], port: int, tmp_path: Path) -> Iterator[subprocess.Popen]:
    log = tmp_path / f"{args[0]}.log"
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", *args, "--port", str(port)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Stream(threading.Thread):
    """One streamed completion: its text pieces as they arrive and its finish reason."""

    def __init__(self, base: str) -> None:
        super().__init__()
        self.base = base
        self.pieces: list[str] = []
        self.finish_reason: str | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.base + "/v1/completions", json=BODY, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        self.pieces.append(choice["text"])
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except httpx.HTTPError as exc:
            self.error = repr(exc)


def drain_with_streams_in_flight(
    base: str, proc: subprocess.Popen, group: bool = False, generator_pid: int | None = None
) -> None:
    """`group`: signal the whole process group with SIGINT, as a terminal's Ctrl-C does.
    `generator_pid`: the process making the tokens when it is not the one answering the
    checks (`up`'s decode worker): stopped while they run, so that the streams are still in
    flight then however slow the host is."""
    reference = Stream(base)
    reference.run()
    assert reference.finish_reason == "length", reference.error
    streams = [Stream(base) for _ in range(STREAMS)]
    for stream in streams:
        stream.start()
    while not all(stream.pieces for stream in streams):
        time.sleep(0.02)
    if generator_pid is not None:
        os.kill(generator_pid, signal.SIGSTOP)
    try:
        if group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        in_flight = [stream.finish_reason is None for stream in streams]
        deadline = time.monotonic() + 30
        while httpx.get(base + "/health", timeout=30).status_code != 503:  # the signal has landed
            assert time.monotonic() < deadline
            time.sleep(0.02)

        refused = httpx.post(base + "/v1/completions", json={**BODY, "stream": False}, timeout=30)
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert not all(stream.finish_reason for stream in streams)  # the checks ran mid-drain
    finally:
        if generator_pid is not None:
            os.kill(generator_pid, signal.SIGCONT)

    for stream in streams:
        stream.join()
    assert any(in_flight)  # the signal came while streams were running
    for stream in streams:
        assert stream.error is None
        assert stream.finish_reason == "length"
        assert "".join(stream.pieces) == "".join(reference.pieces)
    assert proc.wait(timeout=60) == 0


def test_sigterm_to_serve_finishes_its_streams_then_exits(tiny_model, tmp_path):
    port = free_port()
    with started(["serve", tiny_model, "--num-blocks", "1024"], port, tmp_path) as proc:
        drain_with_streams_in_flight(f"http://127.0.0.1:{port}", proc)


@pytest.mark.parametrize("how", ["sigterm to up", "ctrl-c to the group"])
def test_sigterm_to_up_finishes_its_streams_then_exits(tiny_model, tmp_path, how):
    port = free_port()  # the prompt goes through prefill, a KV transfer, then decode
    args = [
        "up",
        tiny_model,
        "--num-blocks",
        "1024",
        "--min-prefill-tokens",
        "2",
        "--pd-decision",
        "threshold",
    ]
    with started(args, port, tmp_path) as proc:
        log = tmp_path / "up.log"
        deadline = time.monotonic() + 30  # the proxy answers a moment before `up` prints its parts
        while "OpenAI API:" not in log.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (decode_pid,) = re.findall(r"^\s+decode-0\s+http://\S+\s+\(pid (\d+)\)", log.read_text(), re.M)
        drain_with_streams_in_flight(
            f"http://127.0.0.1:{port}", proc, group=how != "sigterm to up", generator_pid=int(decode_pid)
        )


def test_past_max_in_flight_429_and_ctrl_c_twice_stops_at_once(tiny_model, tmp_path):
    port = free_port()
    args = ["serve", tiny_model, "--num-blocks", "1024", "--max-in-flight", "1"]
    with started(args, port, tmp_path) as proc:
        base = f"http://127.0.0.1:{port}"
        stream = Stream(base)
        stream.start()
        while not stream.pieces:
            time.sleep(0.02)
        over = httpx.post(base + "/v1/completions", json={**BODY, "stream": False}, timeout=30)
        assert over.status_code == 429, over.text
        assert over.headers["retry-after"] == "1"
        assert over.json()["error"]["type"] == "rate_limit_error"
        assert httpx.get(base + "/health", timeout=30).status_code == 200  # not new work

        proc.send_signal(signal.SIGINT)
        while httpx.get(base + "/health", timeout=30).status_code != 503:  # draining
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        stream.join()
        assert stream.finish_reason != "length"  # cut: it did not wait for the stream
