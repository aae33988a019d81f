"""A fake OpenAI-compatible server (tests/bench/fake_openai_server.py) run as a subprocess."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def fake_server(*flags: str) -> Iterator[str]:
    """Start the fake server with the given flags (e.g. "--itl", "0.002"); yield its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.bench.fake_openai_server", "--port", str(port), *flags],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"fake server exited: {proc.stderr.read().decode()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.05)
        yield url
    finally:
        proc.kill()
        proc.wait()


def splitserve_bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "bench", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def server_stats(url: str) -> dict:
    return httpx.get(url + "/stats", timeout=5).json()


def reset_stats(url: str) -> None:
    httpx.post(url + "/reset", timeout=5).raise_for_status()


@pytest.fixture(scope="session")
def steady_server() -> Iterator[str]:
    """Well-behaved: 20 ms to the first token, then a token every 2 ms. Shared: a test that
    reads its counters calls reset_stats first."""
    with fake_server("--ttft", "0.02", "--itl", "0.002") as url:
        yield url
