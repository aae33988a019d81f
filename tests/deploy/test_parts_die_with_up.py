"""`splitserve up` killed outright (SIGKILL, mid-stream; the issue's case: with an encoder)
leaves nothing behind: within 2 s no process it started remains (the kernel ends them:
`runtime/process_lifetime.py`), their ports are free, no KV segment of theirs is in
/dev/shm, and the next `up` on the same port removes the encoder cache the killed one
left on tmpfs, starts and answers."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import free_port, running_server
from tests.protocol.test_process_lifetime import kill_if_alive, wait_dead
from tests.router.test_migration import GREEDY, Stream
from tests.router.test_pd_proxy import up_log

SHM = Path("/dev/shm")
FLAGS = ["--num-blocks", "256", "--max-model-len", "4096"]


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def children_of(pid: int) -> set[int]:
    """Every process whose parent is `pid`."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if parent_pid(int(entry)) == pid:
                    found.add(int(entry))
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    return found


def port_free(port: int) -> bool:
    """Whether a server could listen on the port now (SO_REUSEADDR, as every part binds)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


TCP_STATES = {
    1: "ESTABLISHED", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 6: "TIME_WAIT", 7: "CLOSE",
    8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING",
}  # fmt: skip


def port_holders(port: int) -> list[str]:
    """Who holds local TCP port `port`: each socket's state and the processes with it open,
    so that a port left taken says by what."""
    inodes: dict[str, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if int(fields[1].rpartition(":")[2], 16) == port:
                    inodes[fields[9]] = TCP_STATES.get(int(fields[3], 16), fields[3])
    owners: dict[str, list[str]] = {inode: [] for inode in inodes}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{entry}/fd/{fd}")
                    inode = target[len("socket:[") : -1] if target.startswith("socket:[") else ""
                    if inode in owners:
                        command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
                        owners[inode].append(f"pid {entry}: {command.decode(errors='replace')[:160]}")
    return [f"port {port} {state} held by {owners[inode] or 'no process'}" for inode, state in inodes.items()]


def taken_ports(ports: list[int], within_s: float) -> list[str]:
    """The holders of those of `ports` still taken after up to `within_s` (a dead process's
    sockets go as it is reaped; the poll only spares the check a race with the kernel)."""
    deadline = time.monotonic() + within_s
    while True:
        taken = [port for port in ports if not port_free(port)]
        if not taken or time.monotonic() > deadline:
            return [holder for port in taken for holder in port_holders(port) or [f"port {port}: no socket"]]
        time.sleep(0.05)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not SHM.is_dir(), reason="Linux, /dev/shm")
def test_a_killed_up_leaves_no_part_port_or_shm_segment_and_up_starts_again(tiny_model_factory):
    model = tiny_model_factory(arch="qwen2_vl")
    port = free_port()
    first = ["up", model, "--port", str(port), "--encoder", "1", "--prefill", "1", "--decode", "1"]
    pids: set[int] = set()
    try:
        with running_server([*first, "--transport", "shm", *FLAGS], port, timeout=240) as base:
            deadline = time.monotonic() + 30
            while "OpenAI API:" not in up_log(port):  # the table comes once every part is healthy
                assert time.monotonic() < deadline, up_log(port)
                time.sleep(0.05)
            table = re.findall(r"^\s+(\S+)\s+(http://\S+)\s+\(pid (\d+)\)", up_log(port), re.M)
            assert {name for name, _, _ in table} == {"render", "prefill-0", "decode-0", "encoder-0", "proxy"}
            up_pid = parent_pid(int(table[0][2]))
            pids = {int(pid) for _, _, pid in table} | children_of(up_pid)
            assert {parent_pid(pid) for pid in pids} == {up_pid}
            (ec_directory,) = SHM.glob(f"splitserve-ec-up-*-{up_pid}-*")
            stream = Stream(base, GREEDY)
            stream.start()
            while not stream.pieces:  # mid-stream: the client has some of the answer
                assert stream.is_alive(), stream.error
                time.sleep(0.01)
            os.kill(up_pid, signal.SIGKILL)  # `up` alone: its clean-up never runs
            assert wait_dead(pids, 2.0) == []
            stream.join(30)
            assert not stream.is_alive() and stream.finish_reason is None  # cut off, not hung
    finally:
        kill_if_alive(pids)

    assert not [path for pid in pids for path in SHM.glob(f"splitserve-kv-{pid}-*")]
    part_ports = [urlsplit(url).port for _, url, _ in table]
    assert taken_ports([p for p in part_ports if p is not None], within_s=2.0) == []
    assert ec_directory.is_dir()  # what only the next `up` can remove

    second = ["up", model, "--port", str(port), "--prefill", "0", "--decode", "1", *FLAGS]
    with running_server(second, port, timeout=240) as base:
        assert not ec_directory.exists()
        assert f"removed {ec_directory}, left by an up that is gone" in up_log(port)
        body = {"prompt": "again", "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4
