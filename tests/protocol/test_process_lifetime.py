"""A child started with `child_command` dies with its parent, however the parent dies
(SIGKILL, or gone before the child could ask the kernel); directories named after a dead
owner are removed by the next sweep, and only those."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from splitserve.runtime.process_lifetime import (
    PARENT_GONE_EXIT_CODE,
    child_command,
    owned_directory,
    remove_dead_owners,
)
from tests.conftest import free_port

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def process_dead(pid: int) -> bool:
    """No such process, or only its zombie (dead, holding nothing, waiting for a reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def wait_dead(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Poll until every process is dead or the deadline passes; the ones left."""
    deadline = time.monotonic() + timeout_s
    left = [pid for pid in pids if not process_dead(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = [pid for pid in left if not process_dead(pid)]
    return left


def kill_if_alive(pids: Iterable[int]) -> None:
    """A failed test leaves no process behind."""
    for pid in pids:
        if not process_dead(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def parent_of_a_child(port: int, then: str) -> subprocess.Popen:
    """A process that starts `splitserve proxy` on `port` as its child, prints the child's
    pid, then waits (`then="wait"`) or exits at once (`"exit"`, most likely before the
    child's interpreter has started)."""
    command = [
        "proxy",
        "--render",
        "http://127.0.0.1:9",
        "--decode",
        "http://127.0.0.1:9",
        "--port",
        str(port),
    ]
    code = (
        "import os, subprocess, sys\n"
        "from splitserve.runtime.process_lifetime import child_command\n"
        f"child = subprocess.Popen(child_command({command!r}))\n"
        "print(child.pid, flush=True)\n"
        f"os._exit(0) if {then!r} == 'exit' else sys.stdin.read()\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def wait_listening(port: int, child: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert not process_dead(child), "the child exited while starting"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"the child never listened on {port}")


@linux_only
def test_a_child_dies_when_its_parent_is_killed():
    port = free_port()
    parent = parent_of_a_child(port, "wait")
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        wait_listening(port, child)  # running its command: long past the launcher's prctl
        parent.kill()  # SIGKILL: the parent's clean-up never runs
        parent.wait()
        assert wait_dead([child], 2.0) == []
    finally:
        parent.kill()
        parent.wait()
        kill_if_alive([child])


@linux_only
def test_a_child_whose_parent_died_before_it_started_does_not_outlive_it():
    parent = parent_of_a_child(free_port(), "exit")
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.wait()
    try:
        # Either the prctl came first (the kernel kills it) or the parent was already gone
        # (the launcher sees another parent and exits): either way it does not live on.
        assert wait_dead([child], 10.0) == []
    finally:
        kill_if_alive([child])


def test_the_launcher_runs_nothing_for_a_parent_that_is_not_its_own():
    ours = subprocess.run(child_command(["--version"]), capture_output=True, text=True, timeout=60)
    assert ours.returncode == 0 and ours.stdout.strip(), ours.stderr
    another = [*child_command(["--version"])[:3], str(os.getpid() + 1), "--version"]
    done = subprocess.run(another, capture_output=True, text=True, timeout=60)
    assert done.returncode == PARENT_GONE_EXIT_CODE
    assert done.stdout == "" and "is gone; not starting" in done.stderr


def test_only_the_directories_of_dead_owners_are_removed(tmp_path):
    prefix = "splitserve-test-"
    code = "from splitserve.runtime.process_lifetime import owned_directory\n"
    code += f"print(owned_directory({prefix!r}, {str(tmp_path)!r}))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    dead = Path(done.stdout.strip())  # its owner has exited
    (dead / "entry.ec").write_bytes(b"x" * 100)
    alive = Path(owned_directory(prefix, str(tmp_path)))  # ours
    namespace, _, rest = dead.name.removeprefix(prefix).partition("-")
    elsewhere = tmp_path / f"{prefix}{int(namespace) + 1}-{rest}"  # a dead pid of another PID namespace
    elsewhere.mkdir()
    unrelated = tmp_path / f"{prefix}notapid"
    unrelated.mkdir()
    assert remove_dead_owners(prefix, str(tmp_path)) == [str(dead)]
    assert not dead.exists() and alive.is_dir() and elsewhere.is_dir() and unrelated.is_dir()
    assert remove_dead_owners(prefix, str(tmp_path)) == []
