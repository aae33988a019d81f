"""Clean shutdown of the KV plane (issue 15): closing transports with transfers in flight
never makes libzmq abort ("Assertion failed: pfd.revents & POLLIN"), and no shared-memory
KV segment outlives its engine, even one SIGKILLed and started again by `up`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from splitserve.kv.transport.shm import segment_path
from tests.conftest import free_port, running_server
from tests.kv.transport_peer import TRANSPORTS
from tests.router.test_pd_proxy import up_log

SHM = Path("/dev/shm")


def segments_of(pid: int) -> list[str]:
    return [path.name for path in SHM.glob(f"splitserve-kv-{pid}-*")] if SHM.is_dir() else []


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_closing_with_transfers_in_flight_never_aborts(kind):
    rounds = 4 if kind == "nixl" else 12  # a NIXL agent takes ~0.3 s to start
    code = f"from tests.kv.transport_peer import churn; churn({kind!r}, {rounds})"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Assertion failed" not in done.stderr
    assert segments_of(int(done.stdout.split()[-1])) == []


def leave_segment(engine_id: str, then: str) -> subprocess.Popen:
    """A process that creates its KV segment, then dies before unlinking it (SIGKILL) or
    stays alive holding it."""
    code = (
        "import os, signal, sys, time\n"
        "from splitserve.kv.transport.shm import segment_path\n"
        f"os.close(os.open(segment_path(os.getpid(), {engine_id!r}), os.O_CREAT | os.O_RDWR, 0o600))\n"
        "print('created', flush=True)\n"
        f"os.kill(os.getpid(), signal.SIGKILL) if {then!r} == 'die' else time.sleep(600)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "created"
    return process


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
def test_up_leaves_no_kv_segment_behind(tiny_model):
    dead = leave_segment("decode-stale", "die")
    dead.wait(30)
    alive = leave_segment("decode-alive", "live")
    stale, kept = segment_path(dead.pid, "decode-stale"), segment_path(alive.pid, "decode-alive")
    assert os.path.exists(stale)
    port = free_port()
    args = ["up", tiny_model, "--port", str(port), "--transport", "shm", "--num-blocks", "256"]
    pids: set[int] = set()
    try:
        with running_server(args, port, timeout=180):
            while "OpenAI API:" not in up_log(port):
                time.sleep(0.1)
            parts = {
                name: int(pid)
                for name, pid in re.findall(r"^\s+(\S+)\s+http://\S+\s+\(pid (\d+)\)", up_log(port), re.M)
            }
            pids.update(parts.values())
            # the engines' start removed what a dead process left, and only that
            assert not os.path.exists(stale)
            assert os.path.exists(kept)
            os.kill(parts["decode-0"], signal.SIGKILL)
            deadline = time.monotonic() + 120
            while "decode-0 started again" not in up_log(port):
                assert time.monotonic() < deadline, up_log(port)[-3000:]
                time.sleep(0.2)
            pids.update(int(pid) for pid in re.findall(r"started again \(pid (\d+)\)", up_log(port)))
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while httpx.get(f"{base}/health", timeout=5).status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert len(pids) >= 5  # render, prefill, decode, proxy, decode started again
        assert [name for pid in pids for name in segments_of(pid)] == []
        assert os.path.exists(kept)
    finally:
        alive.kill()
        alive.wait(30)
        for path in (stale, kept):
            if os.path.exists(path):
                os.unlink(path)
