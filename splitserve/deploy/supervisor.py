"""`up`'s parts as processes, and their supervision: a part that dies is started again,
with the same command on the same port (so the proxy's health checks find it there again
and route to it once it answers), after a backoff that doubles while it keeps dying and
resets once it has run a while. The other parts keep serving meanwhile."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import NamedTuple

from splitserve.deploy.cpu_affinity import THREADS_ENV, pin
from splitserve.runtime.drain import SUPERVISED_ENV
from splitserve.runtime.process_lifetime import child_command

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
STABLE_AFTER_S = 30.0  # a part that ran this long starts again from the first backoff
MAX_QUICK_DEATHS = 6  # a part that dies this often in a row before running stably cannot start


class Part(NamedTuple):
    name: str
    url: str
    process: subprocess.Popen
    command: list[str]
    env: dict[str, str] | None
    started_at: float
    credential: str | None  # the bearer token its /health wants
    cpus: frozenset[int] | None = None  # `up --cpu-affinity`: the CPUs it runs on (None: any)


def start_part(
    name: str,
    command: list[str],
    url: str,
    env: dict[str, str] | None = None,
    credential: str | None = None,
    cpus: frozenset[int] | None = None,
) -> Part:
    # Supervised: a terminal's Ctrl-C (sent to the whole process group) is for `up`, which
    # stops the parts in order (the proxy drains while the parts behind it still serve).
    env = {**(env if env is not None else os.environ), SUPERVISED_ENV: "1"}
    if cpus is not None:
        env[THREADS_ENV] = str(len(cpus))
    # The kernel ends the part when `up` goes, however it goes (runtime/process_lifetime.py).
    # That follows the thread that forks: `up` starts every part from its main thread.
    # Its own session: a terminal's signals reach `up` alone, and `kill_part` reaches the
    # helpers a part started (a compiler building its kernels) with it.
    process = subprocess.Popen(child_command(command), env=env, start_new_session=True)
    if cpus is not None:
        with contextlib.suppress(ProcessLookupError):  # it died at once: the health wait says so
            pin(process.pid, cpus)
    return Part(name, url, process, command, env, time.monotonic(), credential, cpus)


def kill_part(part: Part) -> None:
    """SIGKILL the part and what it started (its process group), and reap it."""
    if part.process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(part.process.pid, signal.SIGKILL)
        part.process.kill()  # where its group could not be signalled
    part.process.wait()


class Supervisor:
    """Restarts dead parts in `parts` (the list is updated in place)."""

    def __init__(self, parts: list[Part]) -> None:
        self.parts = parts
        self.quick_deaths: dict[str, int] = {}
        self.restart_at: dict[str, float] = {}
        self.restarts = 0

    def poll(self) -> str | None:
        """Restart what is due; None, or why `up` must stop (a part that cannot start)."""
        now = time.monotonic()
        for index, part in enumerate(self.parts):
            if part.process.poll() is None:
                continue
            if part.name not in self.restart_at:
                ran_s = now - part.started_at
                deaths = 1 if ran_s > STABLE_AFTER_S else self.quick_deaths.get(part.name, 0) + 1
                self.quick_deaths[part.name] = deaths
                if deaths > MAX_QUICK_DEATHS:
                    return f"{part.name} keeps exiting (code {part.process.returncode}); it cannot start"
                backoff = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (deaths - 1))
                self.restart_at[part.name] = now + backoff
                print(
                    f"splitserve up: {part.name} exited ({part.process.returncode}); "
                    f"starting it again in {backoff:.1f}s",
                    file=sys.stderr,
                    flush=True,
                )
            elif now >= self.restart_at[part.name]:
                del self.restart_at[part.name]
                self.parts[index] = start_part(
                    part.name, part.command, part.url, part.env, part.credential, part.cpus
                )
                self.restarts += 1
                print(
                    f"splitserve up: {part.name} started again (pid {self.parts[index].process.pid})",
                    file=sys.stderr,
                    flush=True,
                )
        return None
